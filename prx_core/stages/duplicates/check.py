"""The `duplicates_one_keeper` check as an aggregate on Ray workers: the committed table's rows,
hash-split by group id (prx_core.compute.groupby), each reducer checking its groups. The driver
receives counts and at most `EXAMPLES` bad group ids, never the table.

After an incremental run only the groups it wrote are checked, whole (their rows looked up by
`group_id`, so a previous row the run failed to delete is seen too), when the version it
started from is on record as checked and passed (`<root>/_state/duplicates_check.json`) and
nothing but row-preserving commits happened since: the other groups are those rows, unchanged.
Otherwise, and after a full run, every group is checked. A run that committed nothing checks
nothing: its version is the one on record as passed (scope `unchanged`). At 1B rows a full check reshuffles the whole table; this one costs
what the run changed."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.compute as pc

from prx_core.compute.groupby import BUCKET_ROWS, bucket_count, fragment_units, gather_keys, hex_ids, shuffle
from prx_core.stages.duplicates.groups import CONFIRM
from prx_core.stages.duplicates.state import untouched_since
from prx_core.store import lance_io, schemas
from prx_core.store.lance_io import StorageOptions, sql_literal
from prx_core.store.lookups import lookup_literals
from prx_core.store.storage import Storage, put_atomic

EXAMPLES = 20
UNIT_ROWS = 1_000_000
LOOKUP_BATCH = 20_000  # keys per IN-list a BTREE answers: 14 us/key at 20k-50k, 29 us at 5k (4M rows)
RECORD = ("_state", "duplicates_check.json")


@dataclass(frozen=True)
class KeeperCheck:
    """Groups and rows checked; groups that break a rule, and a few of their ids."""

    groups: int
    rows: int
    bad_groups: int
    examples: list[str] = field(default_factory=list)
    version: int | None = None
    scope: str = "all"  # "all" groups, the "changed" ones a run wrote, or "unchanged" (the record's)

    @property
    def passed(self) -> bool:
        return self.bad_groups == 0


def bad_groups(rows: pa.Table) -> tuple[int, list[str]]:
    """(groups, sorted ids of the bad ones) of DUPLICATES rows holding whole groups. A group is
    good when it has exactly one keeper, the keeper has the most pixels, every row names that
    keeper and the group's size, and every member is confirmed with the keeper (a group of one is
    a keeper its component holds; a null distance: grouped by the pHash rule, unconfirmed)."""
    if rows.num_rows == 0:
        return 0, []
    keeper_pixels = pc.if_else(rows["keeper"], rows["pixels"], pa.scalar(None, pa.int64()))
    keeper_id = pc.if_else(rows["keeper"], rows["sample_id"], pa.scalar(None, pa.string()))
    table = pa.table({"group_id": rows["group_id"], "keeper": rows["keeper"].cast(pa.int64()), "pixels": rows["pixels"],
                      "keeper_pixels": keeper_pixels, "keeper_id": keeper_id, "size": rows["group_size"],
                      "named": rows["keeper_sample_id"], "far": pc.fill_null(rows["signature_distance"], 0.0)})
    agg = table.group_by("group_id").aggregate([
        ("group_id", "count"), ("keeper", "sum"), ("pixels", "max"), ("keeper_pixels", "max"), ("keeper_id", "max"),
        ("size", "min"), ("size", "max"), ("named", "min"), ("named", "max"), ("far", "max")])
    count = agg["group_id_count"]
    bad = pc.or_kleene(pc.not_equal(agg["keeper_sum"], 1), pc.greater(agg["far_max"], CONFIRM))
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



class Run(Protocol):
    """What the check needs of a `duplicates` run's report."""

    mode: str
    duplicates_version: int
    previous_duplicates_version: int | None


def check_keepers(storage: Storage, run: Run, unit_rows: int = UNIT_ROWS,
                  rows_per_bucket: int = BUCKET_ROWS) -> KeeperCheck:
    """The check of the version `run` left: its changed groups when the version it started from
    is on record as passed, else every group; the result goes on record."""
    uri, options = storage.lance_uri("duplicates"), storage.lance_storage_options()
    table = lance_io.open_table(uri, options)
    if table is None:
        return KeeperCheck(0, 0, 0)
    table = table.checkout_version(run.duplicates_version)
    record, start = load_record(storage), run.previous_duplicates_version
    trusted = record is not None and record["passed"] and start is not None and untouched_since(
        table.checkout_version(start), record["version"], record["rows"])
    if trusted and run.mode == "unchanged" and start == run.duplicates_version:
        check = KeeperCheck(0, 0, 0, version=table.version, scope="unchanged")  # checked and passed before
    elif trusted and run.mode == "incremental":
        check = check_changed_groups(storage, table.version, start, unit_rows, rows_per_bucket)
    else:
        check = check_one_keeper(storage, table.version, unit_rows, rows_per_bucket)
    save_record(storage, check, table.count_rows())
    return check


def check_changed_groups(storage: Storage, version: int, start: int, unit_rows: int = UNIT_ROWS,
                         rows_per_bucket: int = BUCKET_ROWS) -> KeeperCheck:
    """The groups written between `start` and `version` (the group ids of the fragments `version`
    has and `start` had not), each read whole by `group_id` and checked, on workers."""
    import ray

    uri, options = storage.lance_uri("duplicates"), storage.lance_storage_options()
    table = lance_io.require_table(uri, options).checkout_version(version)
    before = {f.fragment_id for f in table.checkout_version(start).get_fragments()}
    new = {f.fragment_id: f.metadata.num_rows for f in table.get_fragments() if f.fragment_id not in before}
    units = fragment_units(table, unit_rows, new)
    if not units:
        return KeeperCheck(0, 0, 0, version=version, scope="changed")
    buckets = bucket_count(sum(u.rows for u in units), rows_per_bucket)
    parts = shuffle(uri, version, units, "true", ["group_id"], "group_id", buckets, options, keys_only=True)
    task = ray.remote(_check_groups_of)
    results = ray.get([task.remote(uri, version, options, refs) for refs in parts])
    examples = sorted(g for _, _, _, ids in results for g in ids)[:EXAMPLES]
    return KeeperCheck(groups=sum(r[0] for r in results), rows=sum(r[1] for r in results),
                       bad_groups=sum(r[2] for r in results), examples=examples, version=version, scope="changed")


def _check_groups_of(uri: str, version: int, options: StorageOptions, parts: list[Any]) -> tuple[int, int, int, list[str]]:
    """Ray task: every row of the bucket's groups (its parts' keys), looked up by group id, checked."""
    keys = gather_keys(parts)
    table = lance_io.require_table(uri, options).checkout_version(version)
    literals = [sql_literal(g) for g in hex_ids(keys).to_pylist()]
    rows = lookup_literals(table, "group_id", literals, schemas.DUPLICATES.names, batch=LOOKUP_BATCH)
    groups, bad = bad_groups(rows)
    return groups, rows.num_rows, len(bad), bad[:EXAMPLES]


def load_record(storage: Storage) -> dict[str, Any] | None:
    """The last check on record: {version, rows (the table's), passed}; None when absent or unreadable."""
    fs, path = storage.filesystem(), storage.uri(*RECORD)
    try:
        fs.invalidate_cache()
        if not fs.exists(path):
            return None
        data = json.loads(fs.cat_file(path))
        return {"version": int(data["version"]), "rows": int(data["rows"]), "passed": bool(data["passed"])}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_record(storage: Storage, check: KeeperCheck, rows: int) -> None:
    """Puts `check` on record unless a newer version is already there (a record is never replaced
    by the check of an older version, whatever order two checks finish in)."""
    old = load_record(storage)
    if check.version is None or (old is not None and old["version"] > check.version):
        return
    payload = {"version": check.version, "rows": rows, "passed": check.passed, "scope": check.scope,
               "groups_checked": check.groups}
    put_atomic(storage.filesystem(), storage.uri(*RECORD), json.dumps(payload, sort_keys=True).encode())
