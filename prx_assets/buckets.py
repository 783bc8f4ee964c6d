"""Asset `buckets`: tier and bucket of every sample (a pure function of its size)."""


import dagster as dg
from dagster_ray import RayResource

from prx_assets.common import GROUP, SOURCES, catalog_source, counts_table, lance_versions, units_metadata
from prx_core.image.buckets import bucket_sizes
from prx_core.stages.buckets import BucketsReport
from prx_core.stages.entry import Progress
from prx_resources import CatalogResource, StorageResource, UnitsResource
from prx_resources.ray import run_stage

CHEAP = dg.AutomationCondition.eager() | dg.AutomationCondition.code_version_changed()
CHECKS = [dg.AssetCheckSpec("buckets_in_trainer_set", asset="buckets", blocking=True,
                            description="Every bucket is one of the PRX trainer's 13 sizes of its tier. Exact, no "
                                        "threshold: buckets come from a pure function of the size, so one outside "
                                        "the set is a code bug (and mds_shards would write a stream the trainer "
                                        "cannot batch), never bad input.")]


def buckets_asset(settings: StorageResource) -> dg.AssetsDefinition:
    @dg.asset(partitions_def=SOURCES, group_name=GROUP, deps=["samples"], check_specs=CHECKS, kinds={"ray", "lance"},
              code_version=f"1-{settings.tier_version()}", automation_condition=CHEAP)
    def buckets(context: dg.AssetExecutionContext, catalog: CatalogResource, storage: StorageResource, ray: RayResource,
                units: UnitsResource) -> dg.MaterializeResult:
        """Dropped samples (below the 384² floor, aspect ratio outside [0.5, 2]) go to `rejects`."""
        source = catalog_source(context, catalog).name
        report: BucketsReport = run_stage(context, ray, "buckets", source=source, storage=storage.storage(),
                                          max_tier=storage.max_tier, progress=Progress(f"buckets[{source}]"),
                                          unit_rows=units.buckets_rows)
        placed = [key.split("/") for key in report.histogram]
        outside = sorted(key for key, (tier, size) in zip(report.histogram, placed)
                         if tuple(int(v) for v in size.split("x")) not in bucket_sizes(int(tier)))
        check = dg.AssetCheckResult(check_name="buckets_in_trainer_set", passed=not outside,
                                    metadata={"rows_checked": report.bucketed, "buckets_checked": len(placed),
                                              "outside": str(outside[:20])})
        return dg.MaterializeResult(
            metadata={"rows": report.rows, "bucketed": report.bucketed, "dropped": sum(report.dropped.values()),
                      "drop_reasons": counts_table(report.dropped, "reason", report.rows),
                      "bucket_histogram": counts_table(report.histogram, "tier/bucket", report.bucketed),
                      **units_metadata(report.units),
                      **lance_versions(samples=report.samples_version, buckets=report.buckets_version)},
            check_results=[check],
            data_version=dg.DataVersion(f"buckets@{report.buckets_version}"),
        )

    return buckets
