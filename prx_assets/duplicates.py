"""Asset `duplicates` (global): identical-pHash groups across all sources, one keeper each.

Eager: it re-runs after every source's `phashes` and then recomputes only the groups the
changed sources touch (prx_core.stages.duplicates); its check is an aggregate on Ray workers."""


import dagster as dg
from dagster_ray import RayResource

from prx_assets.common import GROUP, OWNERS, dataset_metadata, md_table, stage_metadata
from prx_assets.versions import content_version
from prx_core.stages.entry import GroupsReport, Progress
from prx_resources import StorageResource, UnitsResource
from prx_resources.ray import run_stage

CHECKS = [dg.AssetCheckSpec("duplicates_one_keeper", asset="duplicates", blocking=True,
                            description="Every group has exactly one keeper, and it has the most pixels. Exact, no "
                                        "threshold: groups are computed, so a bad group is a pipeline bug, and "
                                        "skip_lists would drop both copies or none. After an incremental run, the "
                                        "groups it wrote (scope: changed) when the version before passed; else all.")]
SAMPLE_ROWS = 30
DESCRIPTION = ("Groups of samples with an identical pHash (Hamming 0) across all sources, one keeper each: the "
               "highest resolution, ties to the smallest sample_id; skip_lists skips the others. Incremental: after a "
               "source changes, only the groups its hashes touch are recomputed.")


@dg.asset(group_name=GROUP, deps=["phashes"], check_specs=CHECKS, kinds={"ray", "lance"}, code_version="1",
          automation_condition=dg.AutomationCondition.eager(), description=DESCRIPTION, owners=OWNERS)
def duplicates(context: dg.AssetExecutionContext, storage: StorageResource, ray: RayResource,
               units: UnitsResource) -> dg.MaterializeResult:
    groups: GroupsReport = run_stage(context, ray, "duplicates", storage=storage.storage(), progress=Progress("duplicates"),
                                     sample_rows=SAMPLE_ROWS, **units.settings("duplicates"))
    report, check, sample = groups.duplicates, groups.check, groups.sample
    context.log.info(f"duplicates: {report.mode} run" + (f" ({report.reason})" if report.reason else "")
                     + f", changed sources {report.changed_sources or 'none'}")
    members = report.groups + report.duplicates  # a keeper and its losers per group
    return dg.MaterializeResult(
        metadata={"groups": report.groups, "duplicates": report.duplicates,
                  "duplicate_rate": dg.MetadataValue.float(round(report.duplicate_rate, 6)),
                  "phashes_rows": report.phashes_rows, "mode": report.mode, "full_reason": report.reason or "-",
                  "changed_sources": ", ".join(report.changed_sources) or "-",
                  "groups_sample": md_table(sample, ["group_id", "sample_id", "source", "keeper", "pixels"]),
                  **dataset_metadata(storage.storage(), members, table="duplicates"),
                  **stage_metadata(groups, hashes_read=report.rows_read, affected_hashes=report.affected_hashes,
                                   member_rows=report.member_rows, rows_written=report.rows_written,
                                   rows_deleted=report.rows_deleted, buckets=report.buckets, map_units=report.map_units)},
        check_results=[dg.AssetCheckResult(check_name="duplicates_one_keeper", passed=check.passed,
                                           metadata={"scope": check.scope, "groups": check.groups,
                                                     "rows_checked": check.rows,
                                                     "bad_groups": check.bad_groups,
                                                     "bad_examples": str(check.examples)})],
        # the groups are a function of every source's hashes: their versions, the code, what it grouped
        data_version=content_version(context, groups=report.groups, duplicates=report.duplicates),
    )
