"""The `duplicates_one_keeper` check as an aggregate on Ray workers: the committed table's rows,
hash-split by group id (prx_core.compute.groupby), each reducer checking its groups. The driver
receives counts and at most `EXAMPLES` bad group ids, never the table."""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from prx_core.compute.groupby import BUCKET_ROWS, bucket_count, fragment_units, shuffle
from prx_core.store import lance_io, schemas
from prx_core.store.storage import Storage

EXAMPLES = 20
UNIT_ROWS = 1_000_000


@dataclass(frozen=True)
class KeeperCheck:
    """Groups and rows checked; groups that break a rule, and a few of their ids."""

    groups: int
    rows: int
    bad_groups: int
    examples: list[str] = field(default_factory=list)
    version: int | None = None

    @property
    def passed(self) -> bool:
        return self.bad_groups == 0


def bad_groups(rows: pa.Table) -> tuple[int, list[str]]:
    """(groups, sorted ids of the bad ones) of DUPLICATES rows holding whole groups. A group is
    good when it has two or more rows, exactly one keeper, the keeper has the most pixels, and
    every row names that keeper and the group's size."""
    if rows.num_rows == 0:
        return 0, []
    keeper_pixels = pc.if_else(rows["keeper"], rows["pixels"], pa.scalar(None, pa.int64()))
    keeper_id = pc.if_else(rows["keeper"], rows["sample_id"], pa.scalar(None, pa.string()))
    table = pa.table({"group_id": rows["group_id"], "keeper": rows["keeper"].cast(pa.int64()), "pixels": rows["pixels"],
                      "keeper_pixels": keeper_pixels, "keeper_id": keeper_id, "size": rows["group_size"],
                      "named": rows["keeper_sample_id"]})
    agg = table.group_by("group_id").aggregate([
        ("group_id", "count"), ("keeper", "sum"), ("pixels", "max"), ("keeper_pixels", "max"), ("keeper_id", "max"),
        ("size", "min"), ("size", "max"), ("named", "min"), ("named", "max")])
    count = agg["group_id_count"]
    bad = pc.or_kleene(pc.less(count, 2), pc.not_equal(agg["keeper_sum"], 1))
    for broken in (pc.less(agg["keeper_pixels_max"], agg["pixels_max"]), pc.not_equal(agg["size_min"], count),
                   pc.not_equal(agg["size_max"], count), pc.not_equal(agg["named_min"], agg["keeper_id_max"]),
                   pc.not_equal(agg["named_max"], agg["keeper_id_max"])):
        bad = pc.or_(bad, pc.fill_null(broken, True))
    ids = agg["group_id"].filter(bad)
    return agg.num_rows, sorted(ids.to_pylist())


def check_one_keeper(storage: Storage, version: int | None = None, unit_rows: int = UNIT_ROWS,
                     rows_per_bucket: int = BUCKET_ROWS) -> KeeperCheck:
    """Check every group of `duplicates` (at `version`, default the latest) on workers."""
    import ray

    uri, options = storage.lance_uri("duplicates"), storage.lance_storage_options()
    table = lance_io.open_table(uri, options)
    if table is None:
        return KeeperCheck(0, 0, 0)
    if version is not None:
        table = table.checkout_version(version)
    units = fragment_units(table, unit_rows)
    if not units:
        return KeeperCheck(0, 0, 0, version=table.version)
    buckets = bucket_count(sum(u.rows for u in units), rows_per_bucket)
    parts = shuffle(uri, table.version, units, "true", schemas.DUPLICATES.names, "group_id", buckets, options)
    results = ray.get([ray.remote(_check_bucket).remote(*refs) for refs in parts])
    examples = sorted(g for _, _, _, ids in results for g in ids)[:EXAMPLES]
    return KeeperCheck(groups=sum(r[0] for r in results), rows=sum(r[1] for r in results),
                       bad_groups=sum(r[2] for r in results), examples=examples, version=table.version)


def _check_bucket(*parts: pa.Table) -> tuple[int, int, int, list[str]]:
    rows = pa.concat_tables([p for p in parts if p is not None]) if parts else schemas.DUPLICATES.empty_table()
    groups, bad = bad_groups(rows)
    return groups, rows.num_rows, len(bad), bad[:EXAMPLES]

