"""Asset `skip_lists`: per stream and reason, what training skips, without rewriting shards."""


import dagster as dg
from dagster_ray import RayResource

from prx_assets.buckets import CHEAP
from prx_assets.common import GROUP, SOURCES, catalog_source, lance_versions, md_table, units_metadata
from prx_core.stages.entry import Progress
from prx_core.stages.skip_lists import SkipReport
from prx_resources import CaptionerResource, CatalogResource, LabelerResource, SkipPolicyResource, StorageResource
from prx_resources.ray import run_stage

REWRITE_ABOVE = 0.10  # substitution over-samples; above this a stream should be rewritten
CHECKS = [dg.AssetCheckSpec("skip_lists_fraction", asset="skip_lists",
                            description=f"Warns when a stream skips more than {REWRITE_ABOVE:.0%} of its samples.")]


def skip_lists_asset(captioner: CaptionerResource, labeler: LabelerResource, policy: SkipPolicyResource) -> dg.AssetsDefinition:
    # "2-": streams gain completion records (the loader refuses streams without one)
    version = f"2-{policy.policy().version()}-{labeler.config().version()}-{captioner.config().version()}"

    @dg.asset(partitions_def=SOURCES, group_name=GROUP, deps=["mds_shards", "duplicates", "caption_labels"],
              check_specs=CHECKS, kinds={"ray"}, code_version=version, automation_condition=CHEAP)
    def skip_lists(
        context: dg.AssetExecutionContext, catalog: CatalogResource, storage: StorageResource,
        captioner: CaptionerResource, labeler: LabelerResource, policy: SkipPolicyResource, ray: RayResource,
    ) -> dg.MaterializeResult:
        rules = policy.policy()
        source = catalog_source(context, catalog).name
        report: SkipReport = run_stage(context, ray, "skip_lists", source=source, storage=storage.storage(),
                                       captioner_version=captioner.config().version(),
                                       labeler_version=labeler.config().version(), policy=rules,
                                       progress=Progress(f"skip_lists[{source}]", unit="chunks"))
        table = [{"stream": s.stream, "samples": s.size, "skipped": s.skipped, "fraction": round(s.fraction, 3),
                  **s.by_reason} for s in report.streams]
        heavy = [s.stream for s in report.streams if s.fraction > REWRITE_ABOVE]
        reasons = sorted({r for s in report.streams for r in s.by_reason})
        return dg.MaterializeResult(
            metadata={"policy_version": rules.version(), "samples": report.samples, "skipped": report.skipped,
                      "skip_fraction": round(report.skipped / max(report.samples, 1), 4), "files": len(report.files),
                      "streams": md_table(table, ["stream", "samples", "skipped", "fraction", *reasons]),
                      **{f"{phase}_{k}": v for phase, r in report.units.items() for k, v in units_metadata(r).items()},
                      **lance_versions(**report.read_versions)},
            check_results=[dg.AssetCheckResult(check_name="skip_lists_fraction", passed=not heavy,
                                               severity=dg.AssetCheckSeverity.WARN,
                                               metadata={"streams_above": str(heavy), "threshold": REWRITE_ABOVE})],
        )

    return skip_lists
