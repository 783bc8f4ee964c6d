"""`duplicates` on Ray against the in-process reference: full runs of any unit and bucket size, then
incremental runs after a source is added, changed or removed (only the components it touches are
recomputed), fragments shared by sources, the reasons for a full run, and a run killed mid-way."""

from __future__ import annotations

import json
import os
from pathlib import Path

import lance
import pyarrow as pa
import pytest
from crash import kill_at, recorded_units
from dup_rows import LOOKALIKE, phash_rows, random_items, write_source

from prx_core.compute.units import RUNS
from prx_core.stages.duplicates.stage import build_duplicates, find_duplicates
from prx_core.stages.duplicates.check import bad_groups, check_one_keeper
from prx_core.stages.duplicates.state import STATE
from prx_core.store import lance_io, schemas
from prx_core.store.partitions import commit_partition, source_predicate
from prx_core.store.storage import Storage

pytestmark = pytest.mark.usefixtures("ray_cluster")
SMALL_CHANGE = 0.5  # these tables are tiny: a one-source change is a large share of their rows

PLANTED = {  # key, picture, copy, pixels, quality, bytes[, lossless]
    "a": [("1", 7, 0, 100, 95, 10), ("2", 7, 1, 400, 75, 50), ("3", 9, 0, 50, 90, 10), ("4", 3, 0, 10, 80, 10),
          ("5", 11, 0, 10, 90, 10), ("6", 5, 0, 5, 90, 5)],
    "b": [("1", 7, 2, 400, 92, 40), ("2", 3, 1, 10, 80, 30), ("3", 11, 1, 10, 90, 10, True), ("4", 12, 0, 1, None, 1),
          ("5", LOOKALIKE + 9, 0, 60, 90, 10)],
    "c": [("1", 3, 2, 10, None, 5), ("2", 12, 1, 1, 90, 1), ("3", 13, 0, 1, 90, 1), ("4", 5, 1, 6, 90, 5)],
}


@pytest.fixture()
def storage(tmp_path: Path) -> Storage:
    """Three sources: planted groups (ties, a group of three across sources, a lossless copy, a
    lookalike sharing a key) plus random copies, several fragments each; `c` is the smallest."""
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


def keeper_of(storage: Storage, sample_id: str) -> str | None:
    rows = [r for r in table(storage) if r["sample_id"] == sample_id]
    return rows[0]["keeper_sample_id"] if rows else None


@pytest.mark.parametrize("unit_rows, rows_per_bucket", [(1000, 1_000_000), (4, 64), (7, 100)])
def test_a_full_run_equals_the_reference(storage: Storage, unit_rows: int, rows_per_bucket: int) -> None:
    report = build_duplicates(storage, unit_rows=unit_rows, rows_per_bucket=rows_per_bucket)
    want = reference(storage)
    assert table(storage) == want
    sizes = {r["group_size"] for r in want}
    assert 2 in sizes and max(sizes) >= 3 and {r["source"] for r in want} == {"a", "b", "c"}
    assert (report.mode, report.reason, report.changed_sources) == ("full", "no state", ["a", "b", "c"])
    total = 36 + 25 + 10
    assert report.rows_read == report.phashes_rows == total and report.rows_written == len(want)
    groups = [r for r in want if r["keeper"] and r["group_size"] >= 2]
    assert report.groups == len(groups) and report.duplicates == sum(not r["keeper"] for r in want)
    assert report.candidate_pairs >= report.confirmed_pairs > 0 and report.rounds >= 3
    assert report.buckets == max(1, min(256, -(-total * 7 // rows_per_bucket))) and report.map_units >= 7
    assert report.units.units == report.buckets and report.fragments_counted == 7
    assert not os.listdir(os.path.join(storage.root, RUNS, "duplicates", "corpus"))  # the attempt is forgotten
    check = check_one_keeper(storage, unit_rows=unit_rows, rows_per_bucket=rows_per_bucket)
    assert check.passed and check.rows == len(want)


def test_planted_groups_keep_the_best_copy_and_refuse_the_lookalike(storage: Storage) -> None:
    build_duplicates(storage)
    assert keeper_of(storage, "a/1") == keeper_of(storage, "a/2") == "b/1"  # 400 px like a/2, q92 beats q75
    rows = {r["sample_id"]: r for r in table(storage)}
    assert rows["b/1"]["keeper"] and rows["b/1"]["signature_distance"] == 0
    assert 0 < rows["a/2"]["signature_distance"] <= 1 and not rows["a/2"]["keeper"]
    assert keeper_of(storage, "a/5") == "b/3"  # equal pixels and quality: the lossless copy
    assert keeper_of(storage, "b/5") is None  # shares a key with picture 9, does not look like it


def test_the_phash_rule_groups_identical_hashes_without_confirming_them(storage: Storage) -> None:
    """The first release's rule, kept for comparison: one key, the pHash; no signature asked."""
    build_duplicates(storage, rows_per_bucket=80)
    report = build_duplicates(storage, rows_per_bucket=80, rule="phash")
    assert (report.mode, report.reason) == ("full", "no state")  # another rule recomputes every group
    want = sorted(find_duplicates(lance_io.read_table(storage.lance_uri("phashes")), rule="phash").to_pylist(),
                  key=_order)
    assert table(storage) == want and report.candidate_pairs == report.confirmed_pairs
    hashes = {r["sample_id"]: r["phash"] for r in lance_io.read_table(storage.lance_uri("phashes")).to_pylist()}
    for group in {r["group_id"] for r in want}:
        assert len({hashes[r["sample_id"]] for r in want if r["group_id"] == group}) == 1
    with pytest.raises(ValueError, match="duplicates rule 'radius'"):
        build_duplicates(storage, rule="radius")


def test_a_rerun_without_change_commits_nothing(storage: Storage) -> None:
    first = build_duplicates(storage, rows_per_bucket=80)
    again = build_duplicates(storage, rows_per_bucket=80)
    assert again.mode == "unchanged" and again.duplicates_version == first.duplicates_version
    assert (again.rows_read, again.fragments_counted, again.groups) == (0, 0, first.groups)
    assert lance_io.table_version(storage.lance_uri("duplicates")) == first.duplicates_version


def test_adding_a_source_reads_only_its_rows(storage: Storage) -> None:
    build_duplicates(storage, rows_per_bucket=80)
    write_source(storage, "d", [("1", 13, 1, 2, 90, 1), ("2", 40, 0, 999, 90, 1), ("3", 7, 3, 999, 90, 1)], fragments=1)
    report = build_duplicates(storage, unit_rows=2, rows_per_bucket=20, full_fraction=SMALL_CHANGE)
    assert table(storage) == reference(storage)
    assert (report.mode, report.changed_sources, report.rows_read, report.previous_rows_read) == (
        "incremental", ["d"], 3, 0)
    assert report.fragments_counted == 1 and keeper_of(storage, "a/1") == "d/3"  # a new best copy of picture 7
    picture_7 = {r["sample_id"] for r in table(storage) if r["keeper_sample_id"] == "d/3"}
    assert report.member_rows < len(table(storage)) and picture_7 <= {"a/1", "a/2", "b/1", "d/3"} | {
        r["sample_id"] for r in table(storage) if r["sample_id"].split("/")[1].startswith("r")}


def test_changing_a_source_recomputes_its_components(storage: Storage) -> None:
    build_duplicates(storage, rows_per_bucket=80)
    assert keeper_of(storage, "c/3") is None and keeper_of(storage, "c/1") is not None
    # c: picture 3 and 12 and 5 gone (12 shrinks to one member: its group vanishes), 7 added with the
    # most pixels (a new keeper), a better copy of 9 (a's)
    write_source(storage, "c", [("9", 7, 4, 10_000, 50, 1), ("8", 9, 2, 60, 90, 10), ("7", 555, 0, 1, 1, 1)],
                 fragments=1)
    report = build_duplicates(storage, unit_rows=2, rows_per_bucket=40, full_fraction=SMALL_CHANGE)
    assert table(storage) == reference(storage)
    assert (report.mode, report.changed_sources, report.rows_read) == ("incremental", ["c"], 3)
    previous = [r for r in table(storage, report.previous_duplicates_version) if r["source"] == "c"]
    assert report.previous_rows_read == len(previous) and report.fragments_counted == 1
    assert report.affected_components >= len({r["component_id"] for r in previous}) and report.rows_deleted > 0
    assert keeper_of(storage, "b/4") is None and keeper_of(storage, "a/2") == "c/9"
    assert keeper_of(storage, "a/3") == keeper_of(storage, "c/8") == "c/8"
    assert check_one_keeper(storage).passed


def test_removing_a_source_reads_only_its_previous_rows(storage: Storage) -> None:
    build_duplicates(storage, rows_per_bucket=80)
    previous = [r for r in table(storage) if r["source"] == "c"]
    commit_partition(storage, "phashes", source_predicate("c"), [])
    report = build_duplicates(storage, unit_rows=3, rows_per_bucket=30, full_fraction=SMALL_CHANGE)
    assert table(storage) == reference(storage)
    assert not [r for r in table(storage) if r["source"] == "c"]
    assert (report.mode, report.changed_sources, report.rows_read) == ("incremental", ["c"], 0)
    assert report.previous_rows_read == len(previous) > 0
    assert report.affected_components == len({r["component_id"] for r in previous})


def test_a_fragment_shared_by_sources_changes_only_the_edited_one(storage: Storage) -> None:
    """`e`, `f`, `g` share a fragment; replacing `e` leaves a deletion vector on it: only `e`
    changed. Deleting one row of `f` in place: only `f` changed, its rest read with a filter."""
    shared = pa.concat_tables([phash_rows("e", [("1", 30, 0, 7, 90, 1), ("2", 31, 0, 1, 90, 1)]),
                               phash_rows("f", [("1", 31, 1, 2, 90, 1), ("2", 11, 2, 9, 90, 1), ("3", 30, 1, 8, 90, 1)]),
                               phash_rows("g", [("1", 31, 2, 3, 90, 1)])])
    commit_partition(storage, "phashes", "source IN ('e', 'f', 'g')",
                     lance_io.write_fragments(storage.lance_uri("phashes"), shared, schemas.PHASHES))
    build_duplicates(storage, rows_per_bucket=80)
    write_source(storage, "e", [("3", 11, 3, 10, 90, 1)], fragments=1)
    report = build_duplicates(storage, unit_rows=1, rows_per_bucket=20, full_fraction=SMALL_CHANGE)
    assert table(storage) == reference(storage)
    assert (report.mode, report.changed_sources, report.rows_read, report.fragments_counted) == (
        "incremental", ["e"], 1, 2)  # the shared fragment is recounted, f's and g's rows in it are the same
    lance.dataset(storage.lance_uri("phashes")).delete("sample_id = 'f/2'")
    report = build_duplicates(storage, unit_rows=1, rows_per_bucket=20, full_fraction=SMALL_CHANGE)
    assert table(storage) == reference(storage)
    assert (report.mode, report.changed_sources, report.rows_read, report.previous_rows_read) == (
        "incremental", ["f"], 2, 2)  # f/1 and f/3 of the shared fragment; f/1 and f/2 were in components (f/3's
    # picture lost its other copy with e/1)
    assert report.map_units == 2 + 2  # one row a unit


def test_full_runs_when_the_state_is_missing_the_table_changed_or_most_rows_changed(storage: Storage) -> None:
    first = build_duplicates(storage, rows_per_bucket=80)
    os.remove(storage.uri(*STATE))
    again = build_duplicates(storage, rows_per_bucket=80)
    assert (again.mode, again.reason) == ("full", "no state") and table(storage) == reference(storage)
    uri = storage.lance_uri("duplicates")
    compacted = lance.dataset(uri).optimize.compact_files(target_rows_per_fragment=1_000_000)
    assert compacted.fragments_removed > 1  # compaction keeps the rows: the table is still trusted
    assert build_duplicates(storage).mode == "unchanged"
    lance.dataset(uri).delete("source = 'b'")  # someone else's edit: not trusted
    write_source(storage, "d", [("1", 13, 1, 2, 90, 1)])
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
    rows = [r for r in good.to_pylist()]
    members = [r for r in rows if not r["keeper"]]
    members[0]["keeper"] = True  # two keepers
    members[1]["group_size"] += 1
    members[2]["signature_distance"] = 1.5  # a member its keeper does not confirm
    groups, bad = bad_groups(pa.Table.from_pylist(rows, schema=schemas.DUPLICATES))
    assert bad == sorted({members[n]["group_id"] for n in range(3)}) and len(bad) >= 2


KILL_SCRIPT = """
import ray, sys
from prx_core.stages.duplicates.stage import build_duplicates
from prx_core.store.storage import Storage
from prx_core.compute.quiet import start_ray
start_ray(sys.argv[2], log_to_driver=False)
build_duplicates(Storage(sys.argv[1]), unit_rows=5, rows_per_bucket=60)
"""


def test_a_killed_run_leaves_the_table_and_resumes(storage: Storage, ray_cluster) -> None:
    first = build_duplicates(storage)
    write_source(storage, "a", random_items(5, 36), fragments=3)
    os.remove(storage.uri(*STATE))  # a full run of 9 buckets
    kill_at("duplicates:reduce:3", KILL_SCRIPT, storage.root, ray_cluster.get_runtime_context().gcs_address)
    assert lance_io.table_version(storage.lance_uri("duplicates")) == first.duplicates_version  # no commit
    recorded = len(recorded_units(storage.root, "duplicates", "corpus"))
    (attempt,) = Path(storage.root, RUNS, "duplicates", "corpus").iterdir()
    params = json.loads((attempt / "run.json").read_text())["manifest"]["params"]
    assert sorted(params) == ["buckets", "mode", "rule", "unit_rows"] and params["mode"] == "full"  # what shapes the
    # output, and what the settings decided
    report = build_duplicates(storage, unit_rows=5, rows_per_bucket=60)
    assert report.units.skipped == recorded >= 3 and report.units.ran == report.buckets - recorded
    assert table(storage) == reference(storage)
