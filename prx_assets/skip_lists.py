"""Asset `skip_lists`: per stream and reason, what training skips, without rewriting shards."""


import dagster as dg
from dagster_ray import RayResource

from prx_assets.conditions import CHEAP
from prx_assets.common import (
    GROUP,
    OWNERS,
    SOURCES,
    catalog_source,
    dataset_metadata,
    md_table,
    rate,
    source_check,
    stage_metadata,
)
from prx_assets.versions import content_version
from prx_assets.declared import from_stage
from prx_core.shards.manifest import current_name
from prx_core.stages.entry import Progress
from prx_core.stages.explorer.stage import groups_digest
from prx_core.stages.skip_lists.stage import SkipReport
from prx_resources import CaptionerResource, CatalogResource, LabelerResource, SkipPolicyResource, StorageResource
from prx_resources.ray import run_stage

REWRITE_ABOVE = 0.10  # substitution over-samples; above this a stream should be rewritten
CHECKS = [source_check("skip_lists_fraction", "skip_lists",
                       description=f"Warns when a stream skips more than {REWRITE_ABOVE:.0%} of its samples.")]
DESCRIPTION = ("Per MDS stream of the source and per reason (losing duplicate, a label the policy skips, unlabelled, "
               "opt-out), the stream positions training skips, under `<root>/skiplists/<source>/...`, with each "
               "stream's completion record (the loader refuses a stream without one), then the source's part of "
               "each tier manifest under `<root>/manifests/<tier>/`, the one file the training loader reads. Shards "
               "are never rewritten; above 10% skipped a stream should be.")
SKIP_SCHEMA = dg.TableSchema(columns=[dg.TableColumn("index", "int64", description="position in the stream"),
                                      dg.TableColumn("sample_id", "string"), dg.TableColumn("reason", "string")])


def skip_lists_asset(captioner: CaptionerResource, labeler: LabelerResource, policy: SkipPolicyResource) -> dg.AssetsDefinition:
    version = (policy.policy().version(), labeler.config().version(), captioner.config().version())

    @dg.asset(partitions_def=SOURCES, group_name=GROUP, check_specs=CHECKS, kinds={"ray"},
              **from_stage("skip_lists", *version), automation_condition=CHEAP,
              description=DESCRIPTION, owners=OWNERS)
    def skip_lists(
        context: dg.AssetExecutionContext, catalog: CatalogResource, storage: StorageResource,
        captioner: CaptionerResource, labeler: LabelerResource, policy: SkipPolicyResource, ray: RayResource,
    ) -> dg.MaterializeResult:
        rules = policy.policy()
        source = catalog_source(context, catalog).name
        store = storage.storage()
        report: SkipReport = run_stage(context, ray, "skip_lists", source=source, storage=store,
                                       captioner_version=captioner.config().version(),
                                       labeler_version=labeler.config().version(), policy=rules,
                                       progress=Progress(f"skip_lists[{source}]", unit="chunks"))
        table = [{"stream": s.stream, "samples": s.size, "skipped": s.skipped, "fraction": round(s.fraction, 3),
                  **s.by_reason} for s in report.streams]
        heavy = [s.stream for s in report.streams if s.fraction > REWRITE_ABOVE]
        reasons = sorted({r for s in report.streams for r in s.by_reason})
        tiers = sorted({int(s.stream.split("/")[0]) for s in report.streams})
        manifests = {str(t): current_name(store.root, t, store.storage_options) for t in tiers}
        return dg.MaterializeResult(
            metadata={"policy_version": rules.version(), "samples": report.samples, "skipped": report.skipped,
                      "skip_fraction": rate(report.skipped, report.samples), "files": len(report.files),
                      "streams": md_table(table, ["stream", "samples", "skipped", "fraction", *reasons]),
                      "manifests": dg.MetadataValue.json(manifests),  # what the training loader reads, per tier
                      **dataset_metadata(store, report.skipped, uri=store.uri("skiplists", source), schema=SKIP_SCHEMA),
                      **stage_metadata(report)},
            check_results=[dg.AssetCheckResult(check_name="skip_lists_fraction", passed=not heavy,
                                               severity=dg.AssetCheckSeverity.WARN, description=(
                f"{len(heavy)} of {len(report.streams)} streams skip more than {REWRITE_ABOVE:.0%} of their samples "
                f"({', '.join(heavy[:4])}{', ...' if len(heavy) > 4 else ''}). The loader substitutes each skipped "
                "sample with another of its stream, so such a stream over-samples what is left. Fix: `prx-corpus "
                "rewrite-stream` writes it without the skipped samples; expected on the demo (planted duplicates "
                "and text images).") if heavy else None,
                                               metadata={"streams_above": str(heavy), "threshold": REWRITE_ABOVE})],
            # the lists are a function of the streams, the duplicates, the labels and the policy (the code
            # version): their versions, and what was skipped per stream and reason
            # and of this source's duplicate groups, not of the global `duplicates` (which every source
            # moves): the explorer, downstream, then reruns when this source's groups changed, not on every run
            data_version=content_version(context, own_part={"duplicates": groups_digest(store, source)},
                                         streams=[(s.stream, s.size, s.skipped, s.by_reason) for s in report.streams]),
        )

    return skip_lists
