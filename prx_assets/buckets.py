"""Asset `buckets`: tier and bucket of every sample (a pure function of its size)."""


import dagster as dg
from dagster_ray import RayResource

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
from prx_assets.conditions import CHEAP
from prx_assets.versions import content_version
from prx_assets.declared import from_stage
from prx_core.image.buckets import bucket_sizes
from prx_core.stages.buckets import BucketsReport
from prx_core.stages.entry import Progress
from prx_resources import CatalogResource, StorageResource, UnitsResource
from prx_resources.ray import run_stage

CHECKS = [source_check("buckets_in_trainer_set", "buckets", blocking=True,
                       description="Every bucket is one of the PRX trainer's 13 sizes of its tier. Exact, no "
                                   "threshold: buckets come from a pure function of the size, so one outside "
                                   "the set is a code bug (and mds_shards would write a stream the trainer "
                                   "cannot batch), never bad input.")]
DESCRIPTION = ("Tier and bucket (one of the trainer's 13 sizes of the tier) of every sample, a pure function of its "
               "size; samples below the 384² floor or with an aspect ratio outside [0.5, 2] are dropped to `rejects`.")


def buckets_asset(settings: StorageResource) -> dg.AssetsDefinition:
    @dg.asset(partitions_def=SOURCES, group_name=GROUP, check_specs=CHECKS, kinds={"ray", "lance"},
              **from_stage("buckets", settings.tier_version()), automation_condition=CHEAP, description=DESCRIPTION,
              owners=OWNERS)
    def buckets(context: dg.AssetExecutionContext, catalog: CatalogResource, storage: StorageResource, ray: RayResource,
                units: UnitsResource) -> dg.MaterializeResult:
        source = catalog_source(context, catalog).name
        report: BucketsReport = run_stage(context, ray, "buckets", source=source, storage=storage.storage(),
                                          max_tier=storage.max_tier, progress=Progress(f"buckets[{source}]"),
                                          **units.settings("buckets"))
        placed = [key.split("/") for key in report.histogram]
        outside = sorted(key for key, (tier, size) in zip(report.histogram, placed)
                         if tuple(int(v) for v in size.split("x")) not in bucket_sizes(int(tier)))
        check = dg.AssetCheckResult(check_name="buckets_in_trainer_set", passed=not outside,
                                    metadata={"rows_checked": report.bucketed, "buckets_checked": len(placed),
                                              "outside": str(outside[:20])})
        dropped = sum(report.dropped.values())
        return dg.MaterializeResult(
            metadata={"rows": report.rows, "bucketed": report.bucketed, "dropped": dropped,
                      "drop_rate": rate(dropped, report.rows),
                      "drop_reasons": counts_table(report.dropped, "reason", report.rows),
                      "bucket_histogram": counts_table(report.histogram, "tier/bucket", report.bucketed),
                      **dataset_metadata(storage.storage(), report.rows, table="buckets"),
                      **stage_metadata(report)},
            check_results=[check],
            # a pure function of the samples' sizes: their version, the code, and what it placed
            data_version=content_version(context, histogram=report.histogram, dropped=report.dropped),
        )

    return buckets
