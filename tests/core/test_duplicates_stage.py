"""`duplicates` as a distributed, incremental group-by on a real local Ray and real Lance tables:
the same rows as the single-process `find_duplicates` for any unit and bucket size; after a
source is added, changed or removed, a run reads that source's rows only and still gives the
reference; a rerun without change commits nothing; a run killed mid-reduce resumes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa
import pytest
from crash import kill_at, recorded_units

from prx_core.compute.groupby import hex_ids, parse_hex_ids
from prx_core.compute.units import RUNS
from prx_core.stages.duplicates import build_duplicates, find_duplicates, group_phashes
from prx_core.stages.duplicates_check import bad_groups, check_one_keeper
from prx_core.stages.duplicates_state import STATE
from prx_core.store import lance_io, schemas
from prx_core.store.partitions import commit_partition, source_predicate
from prx_core.store.storage import Storage

pytestmark = pytest.mark.usefixtures("ray_cluster")
BIG = 2**63 + 12345  # above int64: uint64 end to end
POOL = [3, 7, 11, BIG, 2**64 - 1, 40, 41, 42, 43, 44, 45, 46]
SMALL_CHANGE = 0.5  # these tables are tiny: a one-source change is a large share of their rows


def phash_rows(source: str, items: list[tuple]) -> pa.Table:
    """PHASHES rows from (key, phash, pixels, jpeg_quality, num_bytes)."""
    return pa.Table.from_pylist([{"sample_id": f"{source}/{k}", "source": source, "phash": h, "width": 1, "height": 1,
                                  "pixels": p, "jpeg_quality": q, "num_bytes": n} for k, h, p, q, n in items],
                                schema=schemas.PHASHES)


def random_items(seed: int, n: int, pool: list[int] = POOL) -> list[tuple]:
    """Hashes from a small pool (groups across sources and units), few sizes and qualities (ties)."""
    rng = np.random.default_rng(seed)
    return [(f"r{i:03d}", pool[rng.integers(len(pool))], [100, 400][rng.integers(2)], [None, 80, 95][rng.integers(3)],
             [None, 10, 20][rng.integers(3)]) for i in range(n)]


def write_source(storage: Storage, source: str, items: list[tuple], fragments: int = 2) -> None:
    """Replace `source`'s phashes rows, written as `fragments` fragments."""
    rows, uri = phash_rows(source, items), storage.lance_uri("phashes")
    step = max(1, -(-rows.num_rows // fragments))
    written = [f for i in range(0, rows.num_rows, step) for f in lance_io.write_fragments(uri, rows.slice(i, step),
                                                                                           schemas.PHASHES)]
    commit_partition(storage, "phashes", source_predicate(source), written)


PLANTED = {  # key, phash, pixels, quality, bytes
    "a": [("1", 7, 100, 95, 10), ("2", 7, 400, 75, 50), ("3", 9, 50, 90, 10), ("4", BIG, 10, 80, 10),
          ("5", 11, 10, 90, 10), ("6", 2**64 - 1, 5, 90, 5)],
    "b": [("1", 7, 400, 92, 40), ("2", BIG, 10, 80, 30), ("3", 11, 10, 90, 10), ("4", 12, 1, None, 1)],
    "c": [("1", BIG, 10, None, 5), ("2", 12, 1, 90, 1), ("3", 13, 1, 90, 1), ("4", 2**64 - 1, 6, 90, 5)],
}


@pytest.fixture()
def storage(tmp_path: Path) -> Storage:
    """Three sources: planted groups (ties, a group of three across sources, hashes above 2^63)
    plus random rows, several fragments each; `c` is the smallest."""
    storage = Storage(str(tmp_path / "corpus"))
    write_source(storage, "a", PLANTED["a"] + random_items(1, 30), fragments=3)
    write_source(storage, "b", PLANTED["b"] + random_items(2, 20), fragments=2)
    write_source(storage, "c", PLANTED["c"] + random_items(3, 6), fragments=2)
    return storage


def reference(storage: Storage) -> list[dict]:
    return sorted(find_duplicates(lance_io.read_table(storage.lance_uri("phashes"))).to_pylist(), key=_order)


def table(storage: Storage, version: int | None = None) -> list[dict]:
    return sorted(lance_io.read_table(storage.lance_uri("duplicates"), version=version).to_pylist(), key=_order)


def _order(row: dict) -> tuple:
    return row["group_id"], row["sample_id"]


def rows_of(storage: Storage, source: str) -> int:
    return lance_io.require_table(storage.lance_uri("phashes")).count_rows(filter=source_predicate(source))


def test_group_phashes_equals_the_reference_in_order() -> None:
    rows = pa.concat_tables([phash_rows(s, PLANTED[s] + random_items(i, 40)) for i, s in enumerate("abc")])
    assert group_phashes(rows).equals(find_duplicates(rows))
    assert group_phashes(rows.slice(0, 0)).equals(find_duplicates(rows.slice(0, 0)))
    values = np.array([0, 1, BIG, 2**64 - 1], np.uint64)
    assert hex_ids(values).to_pylist() == [f"{int(v):016x}" for v in values]
    assert (parse_hex_ids(hex_ids(values)) == values).all()


@pytest.mark.parametrize("unit_rows, rows_per_bucket", [(1000, 1_000_000), (4, 16), (7, 5)])
def test_a_full_run_equals_the_reference(storage: Storage, unit_rows: int, rows_per_bucket: int) -> None:
    report = build_duplicates(storage, unit_rows=unit_rows, rows_per_bucket=rows_per_bucket)
    want = reference(storage)
    assert table(storage) == want
    sizes = {r["group_size"] for r in want}
    assert 2 in sizes and max(sizes) >= 3 and {r["source"] for r in want} == {"a", "b", "c"}
    assert (report.mode, report.reason, report.changed_sources) == ("full", "no state", ["a", "b", "c"])
    total = 36 + 24 + 10
    assert report.rows_read == report.phashes_rows == total and report.rows_written == len(want)
    assert report.groups == sum(r["keeper"] for r in want) and report.duplicates == len(want) - report.groups
    assert report.buckets == max(1, -(-total // rows_per_bucket)) and report.map_units >= 7
    assert report.units.units == report.buckets and report.fragments_counted == 7
    assert report.duplicate_rate == pytest.approx(report.duplicates / total)
    assert not os.listdir(os.path.join(storage.root, RUNS, "duplicates", "corpus"))  # the attempt is forgotten
    check = check_one_keeper(storage, unit_rows=unit_rows, rows_per_bucket=rows_per_bucket)
    assert check.passed and (check.groups, check.rows) == (report.groups, len(want))


def test_a_rerun_without_change_commits_nothing(storage: Storage) -> None:
    first = build_duplicates(storage, rows_per_bucket=8)
    again = build_duplicates(storage, rows_per_bucket=8)
    assert again.mode == "unchanged" and again.duplicates_version == first.duplicates_version
    assert (again.rows_read, again.fragments_counted, again.groups) == (0, 0, first.groups)
    assert lance_io.table_version(storage.lance_uri("duplicates")) == first.duplicates_version


def test_adding_a_source_reads_only_its_rows(storage: Storage) -> None:
    build_duplicates(storage, rows_per_bucket=8)
    write_source(storage, "d", [("1", 13, 2, 90, 1), ("2", 3, 999, 90, 1), ("3", 12345, 1, 90, 1)], fragments=1)
    report = build_duplicates(storage, unit_rows=2, rows_per_bucket=2, full_fraction=SMALL_CHANGE)
    assert table(storage) == reference(storage)
    assert (report.mode, report.changed_sources, report.rows_read, report.previous_rows_read) == (
        "incremental", ["d"], 3, 0)
    assert report.affected_hashes == 3 and report.fragments_counted == 1
    members = sum(rows_of(storage, s) for s in "abcd") - report.member_rows
    assert report.member_rows == lance_io.require_table(storage.lance_uri("phashes")).count_rows(
        filter="phash IN (13, 3, 12345)") and members > 0  # the groups' members, not the table
    assert report.units.units == report.buckets == 2


def test_changing_a_source_recomputes_its_groups(storage: Storage) -> None:
    build_duplicates(storage, rows_per_bucket=8)
    before = {r["group_id"]: r for r in table(storage) if r["keeper"]}
    # c: BIG and 2^64-1 and 12 and 13 gone (12 and 2^64-1 shrink to one member: those groups vanish),
    # 7 added with the most pixels (a new keeper), 9 added (a's lone hash becomes a group)
    write_source(storage, "c", [("9", 7, 10_000, 50, 1), ("8", 9, 60, 90, 10), ("7", 555, 1, 1, 1)], fragments=1)
    report = build_duplicates(storage, unit_rows=2, rows_per_bucket=4, full_fraction=SMALL_CHANGE)
    after = {r["group_id"]: r for r in table(storage) if r["keeper"]}
    assert table(storage) == reference(storage)
    assert (report.mode, report.changed_sources, report.rows_read) == ("incremental", ["c"], 3)
    previous = [r for r in table(storage, report.previous_duplicates_version) if r["source"] == "c"]
    assert report.previous_rows_read == len(previous) and report.fragments_counted == 1
    assert report.affected_hashes == len({r["group_id"] for r in previous} | {f"{h:016x}" for h in (7, 9, 555)})
    assert f"{12:016x}" in before and f"{12:016x}" not in after
    assert before[f"{7:016x}"]["sample_id"] != "c/9" and after[f"{7:016x}"]["sample_id"] == "c/9"
    assert f"{9:016x}" not in before and after[f"{9:016x}"]["sample_id"] == "c/8"
    assert report.rows_deleted > 0
    assert check_one_keeper(storage).passed


def test_removing_a_source_reads_only_its_previous_rows(storage: Storage) -> None:
    build_duplicates(storage, rows_per_bucket=8)
    previous = [r for r in table(storage) if r["source"] == "c"]
    commit_partition(storage, "phashes", source_predicate("c"), [])
    report = build_duplicates(storage, unit_rows=3, rows_per_bucket=3, full_fraction=SMALL_CHANGE)
    assert table(storage) == reference(storage)
    assert not [r for r in table(storage) if r["source"] == "c"]
    assert (report.mode, report.changed_sources, report.rows_read) == ("incremental", ["c"], 0)
    assert report.previous_rows_read == len(previous)
    assert report.affected_hashes == len({r["group_id"] for r in previous})


def test_a_fragment_shared_by_sources_changes_only_the_edited_one(storage: Storage) -> None:
    """`e`, `f`, `g` share a fragment; replacing `e` leaves a deletion vector on it: only `e`
    changed. Deleting one row of `f` in place: only `f` changed, its rest read with a filter."""
    shared = pa.concat_tables([phash_rows("e", [("1", 3, 7, 90, 1), ("2", 46, 1, 90, 1)]),
                               phash_rows("f", [("1", 46, 2, 90, 1), ("2", 11, 9, 90, 1), ("3", 3, 8, 90, 1)]),
                               phash_rows("g", [("1", 46, 3, 90, 1)])])
    commit_partition(storage, "phashes", "source IN ('e', 'f', 'g')",
                     lance_io.write_fragments(storage.lance_uri("phashes"), shared, schemas.PHASHES))
    build_duplicates(storage, rows_per_bucket=8)
    write_source(storage, "e", [("3", 11, 10, 90, 1)], fragments=1)
    report = build_duplicates(storage, unit_rows=1, rows_per_bucket=2, full_fraction=SMALL_CHANGE)
    assert table(storage) == reference(storage)
    assert (report.mode, report.changed_sources, report.rows_read, report.fragments_counted) == (
        "incremental", ["e"], 1, 2)  # the shared fragment is recounted, f's and g's rows in it are the same
    lance.dataset(storage.lance_uri("phashes")).delete("sample_id = 'f/2'")
    report = build_duplicates(storage, unit_rows=1, rows_per_bucket=2, full_fraction=SMALL_CHANGE)
    assert table(storage) == reference(storage)
    assert (report.mode, report.changed_sources, report.rows_read, report.previous_rows_read) == (
        "incremental", ["f"], 2, 3)  # f/1 and f/3 of the shared fragment; f/1, f/2, f/3 were in groups
    assert report.map_units == 2 + 3  # one row a unit


def test_full_runs_when_the_state_is_missing_the_table_changed_or_most_rows_changed(storage: Storage) -> None:
    first = build_duplicates(storage, rows_per_bucket=8)
    os.remove(storage.uri(*STATE))
    again = build_duplicates(storage, rows_per_bucket=8)
    assert (again.mode, again.reason) == ("full", "no state") and table(storage) == reference(storage)
    uri = storage.lance_uri("duplicates")
    compacted = lance.dataset(uri).optimize.compact_files(target_rows_per_fragment=1_000_000)
    assert compacted.fragments_removed > 1  # compaction keeps the rows: the table is still trusted
    assert build_duplicates(storage).mode == "unchanged"
    lance.dataset(uri).delete("source = 'b'")  # someone else's edit: not trusted
    write_source(storage, "d", [("1", 13, 2, 90, 1)])
    changed = build_duplicates(storage, full_fraction=SMALL_CHANGE)
    assert changed.mode == "full" and changed.reason.startswith("duplicates changed since")
    assert table(storage) == reference(storage)
    write_source(storage, "a", random_items(9, 40))  # a holds most rows
    most = build_duplicates(storage, full_fraction=SMALL_CHANGE)
    assert (most.mode, most.reason, most.changed_sources) == ("full", "the changed sources hold more than 50% of the rows",
                                                              ["a"])
    assert table(storage) == reference(storage) and first.groups > 0


def test_bad_groups_are_found() -> None:
    good = find_duplicates(pa.concat_tables([phash_rows(s, PLANTED[s]) for s in "abc"]))
    assert bad_groups(good) == (len(set(good["group_id"].to_pylist())), [])
    rows = good.to_pylist()
    rows[0]["keeper"] = not rows[0]["keeper"]  # two keepers or none
    rows[-1]["group_size"] += 1
    groups, bad = bad_groups(pa.Table.from_pylist(rows, schema=schemas.DUPLICATES))
    assert bad == sorted({rows[0]["group_id"], rows[-1]["group_id"]})


KILL_SCRIPT = """
import ray, sys
from prx_core.stages.duplicates import build_duplicates
from prx_core.store.storage import Storage
ray.init(address=sys.argv[2], log_to_driver=False)
build_duplicates(Storage(sys.argv[1]), unit_rows=5, rows_per_bucket=10)
"""


def test_a_killed_run_leaves_the_table_and_resumes(storage: Storage, ray_cluster) -> None:
    first = build_duplicates(storage)
    write_source(storage, "a", random_items(5, 36), fragments=3)
    os.remove(storage.uri(*STATE))  # a full run of 7 buckets
    kill_at("duplicates:reduce:3", KILL_SCRIPT, storage.root, ray_cluster.get_runtime_context().gcs_address)
    assert lance_io.table_version(storage.lance_uri("duplicates")) == first.duplicates_version  # no commit
    recorded = len(recorded_units(storage.root, "duplicates", "corpus"))
    (attempt,) = Path(storage.root, RUNS, "duplicates", "corpus").iterdir()
    params = json.loads((attempt / "run.json").read_text())["manifest"]["params"]
    assert sorted(params) == ["buckets", "mode", "unit_rows"] and params["mode"] == "full"  # what the settings decided
    report = build_duplicates(storage, unit_rows=5, rows_per_bucket=10)
    assert report.units.skipped == recorded >= 3 and report.units.ran == report.buckets - recorded
    assert table(storage) == reference(storage)
