"""Asset `caption_labels`: visual / text / nsfw from caption text."""


import dagster as dg
from dagster_ray import RayResource

from prx_assets.buckets import CHEAP
from prx_assets.common import GROUP, SOURCES, catalog_source, counts_table, lance_versions, units_metadata
from prx_assets.rate_checks import rate_check, rate_description
from prx_core.stages.entry import Progress
from prx_core.stages.labels import LabelsReport
from prx_resources import CaptionerResource, CatalogResource, LabelerResource, StorageResource
from prx_resources.checks import ChecksResource
from prx_resources.ray import run_stage

CHECKS = [dg.AssetCheckSpec("caption_labels_coverage", asset="caption_labels", blocking=True,
                            description=rate_description("caption_labels_coverage",
                                                         "Captioned eligible contents with a label; skip_lists skips "
                                                         "the others (`unlabelled`) while its policy skips labels."))]


def caption_labels_asset(captioner: CaptionerResource, labeler: LabelerResource) -> dg.AssetsDefinition:
    @dg.asset(partitions_def=SOURCES, group_name=GROUP, deps=["captions"], check_specs=CHECKS, kinds={"ray", "lance"},
              code_version=f"{labeler.config().version()}-{captioner.config().version()}", automation_condition=CHEAP,
              pool="gpu" if labeler.uses_gpus() else None)
    def caption_labels(
        context: dg.AssetExecutionContext, catalog: CatalogResource, storage: StorageResource,
        captioner: CaptionerResource, labeler: LabelerResource, ray: RayResource, checks: ChecksResource,
    ) -> dg.MaterializeResult:
        catalog_source(context, catalog)
        config = labeler.config()
        report: LabelsReport = run_stage(context, ray, "caption_labels", source=context.partition_key,
                                         storage=storage.storage(), captioner_version=captioner.config().version(),
                                         config=config, actors=labeler.actors,
                                         progress=Progress(f"caption_labels[{context.partition_key}]"))
        labelled = sum(report.distribution.values())
        return dg.MaterializeResult(
            metadata={"labeler": config.labeler_id(), "captioned": report.captioned, "reused": report.reused,
                      "labelled": report.labelled, "failed": report.failed, **units_metadata(report.units),
                      "lance_commits": report.commits,
                      **({"gpu_hours": round(report.gpu_hours, 4)} if report.gpu_hours is not None else {}),
                      "failures": counts_table(report.failures, "reason"),
                      "label_distribution": counts_table(report.distribution, "label"),
                      **lance_versions(**report.read_versions, caption_labels=report.labels_version)},
            check_results=[rate_check("caption_labels_coverage", checks, checked=report.captioned,
                                      failed=max(report.captioned - labelled, 0), offenders=report.offenders,
                                      captioned=report.captioned, labelled=labelled)],
            data_version=dg.DataVersion(f"caption_labels@{report.labels_version}"),
        )

    return caption_labels
