"""Asset `duplicates` (global): groups of copies of one picture across all sources, one keeper each.

Eager: it re-runs after every source's `phashes` and then recomputes only the components the
changed sources touch (prx_core.stages.duplicates.stage); its check is an aggregate on Ray workers."""


import dagster as dg
from dagster_ray import RayResource

from prx_assets.common import GROUP, OWNERS, dataset_metadata, link_build_report, md_table, stage_metadata
from prx_assets.conditions import eager_on_new_data
from prx_assets.versions import content_version
from prx_assets.declared import from_stage
from prx_core.stages.duplicates.stage import GroupsReport
from prx_core.stages.entry import Progress
from prx_resources import SkipPolicyResource, StorageResource, UnitsResource
from prx_resources.ray import run_stage

CHECKS = [dg.AssetCheckSpec("duplicates_one_keeper", asset="duplicates", blocking=True,
                            description="Every group has exactly one keeper, it has the most pixels, and every member "
                                        "is confirmed with it (signature distance <= 1). Exact, no "
                                        "threshold: groups are computed, so a bad group is a pipeline bug, and "
                                        "skip_lists would drop both copies or none. After an incremental run, the "
                                        "groups it wrote (scope: changed) when the version before passed; else all.")]
SAMPLE_ROWS = 30
DESCRIPTION = ("Groups of copies of one picture across all sources (re-encodes, resizes, PNG/WebP copies): "
               "found by pHash match keys, each confirmed by a 16x16 signature, so flat or watermarked pictures "
               "never merge. One keeper each: the highest resolution, then lossless, then JPEG quality, then bytes; "
               "skip_lists skips the others. Incremental: after a source changes, only the components it touches "
               "are recomputed.")


@dg.asset(group_name=GROUP, check_specs=CHECKS, kinds={"ray", "lance"}, **from_stage("duplicates"),
          automation_condition=eager_on_new_data(), description=DESCRIPTION, owners=OWNERS)
def duplicates(context: dg.AssetExecutionContext, storage: StorageResource, ray: RayResource,
               units: UnitsResource, policy: SkipPolicyResource) -> dg.MaterializeResult:
    link_build_report(context)
    groups: GroupsReport = run_stage(context, ray, "duplicates", storage=storage.storage(), progress=Progress("duplicates"),
                                     sample_rows=SAMPLE_ROWS, rule=policy.duplicates_rule, **units.settings("duplicates"))
    report, check, sample = groups.duplicates, groups.check, groups.sample
    context.log.info(f"duplicates: {report.mode} run" + (f" ({report.reason})" if report.reason else "")
                     + f", changed sources {report.changed_sources or 'none'}")
    members = report.groups + report.duplicates  # a keeper and its losers per group (not the groups of one)
    return dg.MaterializeResult(
        metadata={"groups": report.groups, "duplicates": report.duplicates,
                  "duplicate_rate": dg.MetadataValue.float(round(report.duplicate_rate, 6)),
                  "phashes_rows": report.phashes_rows, "mode": report.mode, "full_reason": report.reason or "-",
                  "changed_sources": ", ".join(report.changed_sources) or "-",
                  "groups_sample": md_table(sample, ["group_id", "sample_id", "source", "keeper", "pixels"]),
                  **dataset_metadata(storage.storage(), members, table="duplicates"),
                  "candidate_pairs": report.candidate_pairs, "confirmed_pairs": report.confirmed_pairs,
                  "skipped_keys": report.skipped_keys,
                  **stage_metadata(groups, hashes_read=report.rows_read, affected_components=report.affected_components,
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
