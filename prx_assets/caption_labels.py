"""Asset `caption_labels`: visual / text / nsfw from caption text."""


import dagster as dg
from dagster_ray import RayResource

from prx_assets.conditions import CHEAP
from prx_assets.common import (
    GROUP,
    OWNERS,
    SOURCES,
    catalog_source,
    counts_table,
    dataset_metadata,
    rate,
    source_check,
    stage_metadata,
)
from prx_assets.rate_checks import rate_check, rate_description
from prx_assets.versions import content_version
from prx_assets.declared import from_stage
from prx_core.stages.entry import Progress
from prx_core.stages.labels import LabelsReport
from prx_resources import CaptionerResource, CatalogResource, LabelerResource, StorageResource, UnitsResource
from prx_resources.checks import ChecksResource
from prx_resources.ray import run_stage

CHECKS = [source_check("caption_labels_coverage", "caption_labels", blocking=True,
                       description=rate_description("caption_labels_coverage",
                                                    "Captioned eligible contents with a label; skip_lists skips "
                                                    "the others (`unlabelled`) while its policy skips labels."))]
DESCRIPTION = ("A label of every captioned content of the source (visual, text or nsfw, judged from the caption text "
               "by the configured labeller), in the shared `caption_labels` table keyed by content, captioner and "
               "labeller version; skip_lists skips what the policy names (text and nsfw by default).")


def caption_labels_asset(captioner: CaptionerResource, labeler: LabelerResource) -> dg.AssetsDefinition:
    @dg.asset(partitions_def=SOURCES, group_name=GROUP, check_specs=CHECKS, kinds={"ray", "lance"},
              **from_stage("caption_labels", labeler.config().version(), captioner.config().version()),
              automation_condition=CHEAP,
              pool="gpu" if labeler.uses_gpus() else None, description=DESCRIPTION, owners=OWNERS)
    def caption_labels(
        context: dg.AssetExecutionContext, catalog: CatalogResource, storage: StorageResource,
        captioner: CaptionerResource, labeler: LabelerResource, ray: RayResource, checks: ChecksResource,
        units: UnitsResource,
    ) -> dg.MaterializeResult:
        catalog_source(context, catalog)
        config = labeler.config()
        report: LabelsReport = run_stage(context, ray, "caption_labels", source=context.partition_key,
                                         storage=storage.storage(), captioner_version=captioner.config().version(),
                                         config=config, actors=labeler.actors,
                                         progress=Progress(f"caption_labels[{context.partition_key}]"),
                                         **units.settings("caption_labels"))
        labelled = sum(report.distribution.values())
        return dg.MaterializeResult(
            metadata={"labeler": config.labeler_id(), "captioned": report.captioned, "reused": report.reused,
                      "labelled": report.labelled, "failed": report.failed,
                      "labelled_share": rate(labelled, report.captioned),
                      **({"gpu_hours": dg.MetadataValue.float(round(report.gpu_hours, 4))}
                         if report.gpu_hours is not None else {}),
                      "failures": counts_table(report.failures, "reason"),
                      "label_distribution": counts_table(report.distribution, "label"),
                      **dataset_metadata(storage.storage(), labelled, table="caption_labels"),
                      **stage_metadata(report, lance_commits=report.commits)},
            check_results=[rate_check("caption_labels_coverage", checks, checked=report.captioned,
                                      failed=max(report.captioned - labelled, 0), offenders=report.offenders,
                                      captioned=report.captioned, labelled=labelled)],
            # labels are stored once per content and model versions and reused: the captions' version, the
            # labeller, and the label counts of the partition after the run
            data_version=content_version(context, captioned=report.captioned, distribution=report.distribution),
        )

    return caption_labels
