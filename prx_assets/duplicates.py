"""Asset `duplicates` (global): identical-pHash groups across all sources, one keeper each."""


import dagster as dg

from prx_assets.common import GROUP, lance_versions, md_table
from prx_core.stages.duplicates import build_duplicates
from prx_core.store import lance_io
from prx_resources import StorageResource

CHECKS = [dg.AssetCheckSpec("duplicates_one_keeper", asset="duplicates", blocking=True,
                            description="Every group has exactly one keeper, and it has the most pixels.")]


@dg.asset(group_name=GROUP, deps=["phashes"], check_specs=CHECKS, kinds={"lance"}, code_version="1",
          automation_condition=dg.AutomationCondition.eager())
def duplicates(context: dg.AssetExecutionContext, storage: StorageResource) -> dg.MaterializeResult:
    """Hamming-0 groups; the keeper is the highest resolution, ties to the smallest sample_id."""
    store = storage.storage()
    report = build_duplicates(store)
    table = lance_io.read_table(store.lance_uri("duplicates"), storage_options=store.lance_storage_options())
    groups: dict[str, list[dict]] = {}
    for member in table.to_pylist():
        groups.setdefault(member["group_id"], []).append(member)
    bad = [g for g, members in sorted(groups.items())
           if [m["keeper"] for m in members].count(True) != 1
           or next(m for m in members if m["keeper"])["pixels"] < max(m["pixels"] for m in members)]
    sample = table.sort_by([("group_id", "ascending"), ("keeper", "descending")]).slice(0, 30)
    return dg.MaterializeResult(
        metadata={"hashes_read": report.rows_read, "groups": report.groups, "duplicates": report.duplicates,
                  "duplicate_rate": round(report.duplicate_rate, 4),
                  "groups_sample": md_table(sample.select(["group_id", "sample_id", "keeper", "pixels"]).to_pylist()),
                  **lance_versions(phashes=report.phashes_version, duplicates=report.duplicates_version)},
        check_results=[dg.AssetCheckResult(check_name="duplicates_one_keeper", passed=not bad,
                                           metadata={"groups": report.groups, "bad_groups": str(bad[:20])})],
        data_version=dg.DataVersion(f"duplicates@{report.duplicates_version}"),
    )
