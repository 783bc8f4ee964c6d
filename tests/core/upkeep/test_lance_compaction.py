"""Partition-aware compaction on real Lance tables: rows unchanged, no fragment mixing two
partitions, small fragments merged, deletions purged, indexes still answering, and a partition
replace committing in the middle of it lands whole."""

from __future__ import annotations

import random
from pathlib import Path

import lance
import pyarrow as pa
import pytest
from test_lance_io import SCHEMA, content, content_of, rows, where

from prx_core.compute.parallel import on_cluster
from prx_core.stages.opt_out.apply import delete_rows
from prx_core.store import lance_io as lio
from prx_core.store import maintenance as maint
from prx_core.store.storage import Storage
from prx_core.upkeep import compaction as lc

pytestmark = pytest.mark.usefixtures("ray_cluster")  # partitions are rewritten by Ray tasks


def sources_per_fragment(uri: str, column: str = "source") -> list[set]:
    return [set(f.to_table(columns=[column])[column].to_pylist()) for f in lance.dataset(uri).get_fragments()]


def build(uri: str, sources: str, n: int = 40, per_file: int = 10) -> None:
    for source in sources:
        lio.replace_rows(uri, where(source), lio.write_fragments(uri, rows(source, n), SCHEMA, max_rows_per_file=per_file), SCHEMA)


def test_small_fragments_merge_per_source_and_a_rerun_is_a_no_op(tmp_path: Path) -> None:
    uri = str(tmp_path / "t.lance")
    build(uri, "abc")
    snapshot = content(uri)
    assert len(lance.dataset(uri).get_fragments()) == 12
    report = lc.compact_partitions(uri, ["source"], target_rows=1000)
    assert (report.removed, report.written, report.partitions, report.mixed_split) == (12, 3, 3, 0)
    assert content(uri) == snapshot
    assert sorted(map(sorted, sources_per_fragment(uri))) == [["a"], ["b"], ["c"]]
    again = lc.compact_partitions(uri, ["source"], target_rows=1000)
    assert (again.removed, again.written, again.version) == (0, 0, report.version)  # nothing to do: no commit


def test_mixed_fragments_are_split_and_a_replace_then_drops_whole_fragments(tmp_path: Path) -> None:
    uri = str(tmp_path / "mixed.lance")
    build(uri, "ab")
    lc.compact_table(uri, target_rows_per_fragment=1000)  # Lance's compact_files: one fragment, both sources
    assert sources_per_fragment(uri) == [{"a", "b"}]
    snapshot = content(uri)
    report = lc.compact_table(uri, target_rows_per_fragment=1000, partition_columns=["source"])
    assert (report.mixed_fragments_split, report.partitions_rewritten) == (1, 2) and content(uri) == snapshot
    assert sorted(map(sorted, sources_per_fragment(uri))) == [["a"], ["b"]]
    lio.replace_partition(uri, where("a"), rows("a", 5, "v2"), SCHEMA)
    assert all(f.metadata.deletion_file is None for f in lance.dataset(uri).get_fragments())  # whole fragments went
    assert content(uri, "a") == content_of(rows("a", 5, "v2")) and content(uri, "b") == content_of(rows("b", 40))


def test_deleted_rows_are_purged(tmp_path: Path) -> None:
    uri = str(tmp_path / "deleted.lance")
    build(uri, "ab", n=20, per_file=20)
    lance.dataset(uri).delete("source = 'a' AND value < 5")
    snapshot = content(uri)
    report = lc.compact_partitions(uri, ["source"], target_rows=1000)
    assert (report.partitions, report.removed, report.written) == (1, 1, 1)  # only a's fragment is rewritten
    assert content(uri) == snapshot and maint.fragment_health(uri, target_rows=1000).deleted_rows == 0
    lance.dataset(uri).delete("source = 'b' AND value = 0")  # 1 row of 20: not worth rewriting the fragment
    assert lc.compact_partitions(uri, ["source"], target_rows=1000).removed == 0
    assert len(lance.dataset(uri).get_fragments()) == 2


def test_two_column_partitions_like_rejects(tmp_path: Path) -> None:
    uri = str(tmp_path / "rejects.lance")
    schema = pa.schema([("source", pa.string()), ("stage", pa.string()), ("n", pa.int64())])
    for source in "ab":
        for stage in ("samples", "buckets"):
            table = pa.table({"source": [source] * 4, "stage": [stage] * 4, "n": list(range(4))}, schema=schema)
            predicate = f"{where(source)} AND stage = {lio.sql_literal(stage)}"
            for part in (table.slice(0, 2), table.slice(2)):  # two small fragments per (source, stage)
                frags = lio.write_fragments(uri, part, schema)
                ds = lio.open_table(uri)
                if ds is None:
                    lio.replace_rows(uri, predicate, frags, schema)
                else:
                    lance.LanceDataset.commit(ds, lance.LanceOperation.Append(frags), read_version=ds.version)
    lc.compact_table(uri, target_rows_per_fragment=1000, partition_columns=["source", "stage"])
    ds = lance.dataset(uri)
    keys = [set(zip(*(f.to_table(columns=["source", "stage"])[c].to_pylist() for c in ("source", "stage"))))
            for f in ds.get_fragments()]
    assert sorted(len(k) for k in keys) == [1, 1, 1, 1] and ds.count_rows() == 16


def test_indexes_answer_after_compaction(tmp_path: Path) -> None:
    uri = str(tmp_path / "fts.lance")
    build(uri, "ab")
    maint.refresh_indexes(uri, ["caption"])
    lc.compact_table(uri, target_rows_per_fragment=1000, partition_columns=["source"])
    ds = lance.dataset(uri)
    hits = ds.to_table(full_text_query="caption", columns=["sample_id"])
    assert len(hits) == 80
    index = next(d for d in ds.describe_indices() if d.field_names == ["caption"])
    covered = {int(i) for segment in index.segments for i in segment.fragment_ids}
    assert {f.fragment_id for f in ds.get_fragments()} <= covered


def test_a_replace_committed_mid_compaction_lands_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A partition rerun commits while compaction writes: compaction conflicts, plans again, and
    the rerun's rows are all there, once, with no old row of that partition back."""
    uri = str(tmp_path / "race.lance")
    build(uri, "ab")
    real = lc.imap_tasks
    raced: list[int] = []

    def write_then_race(*args, **kwargs):  # the rewrite tasks run while the rerun commits
        results = list(real(*args, **kwargs))
        if not raced:
            raced.append(lio.replace_partition(uri, where("a"), rows("a", 7, "rerun"), SCHEMA))
        return iter(results)

    plans: list[dict] = []
    real_plan = lc.plan_compaction

    def counted_plan(*args, **kwargs):
        plans.append(real_plan(*args, **kwargs)[0])
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(lc, "imap_tasks", write_then_race)
    monkeypatch.setattr(lc, "plan_compaction", counted_plan)
    lc.compact_partitions(uri, ["source"], target_rows=1000)
    assert raced and len(plans) == 2  # the first commit conflicted with the rerun and was planned again
    assert set(plans[1]) == {("b",)}  # a is one fresh fragment now: nothing to merge
    assert content(uri, "a") == content_of(rows("a", 7, "rerun"))
    assert content(uri, "b") == content_of(rows("b", 40))
    assert all(len(s) == 1 for s in sources_per_fragment(uri))



def test_an_opt_out_committed_mid_compaction_stays_deleted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Compaction takes none of the locks `opt-out` holds: Lance's conflict detection is what keeps
    an opt-out's delete, committed while compaction rewrites the same fragments, from being undone
    by compaction's commit (which would bring the row back). The commit conflicts, compaction plans
    again from the version with the delete."""
    storage = Storage(str(tmp_path))
    uri = storage.lance_uri("samples")
    build(uri, "ab")
    real = lc.imap_tasks
    deleted: list[int] = []

    def write_then_opt_out(*args, **kwargs):  # the rewrite tasks have read a/3; the opt-out commits now
        results = list(real(*args, **kwargs))
        if not deleted:
            deleted.append(delete_rows(storage, "samples", pa.array(["a/3"])))
        return iter(results)

    monkeypatch.setattr(lc, "imap_tasks", write_then_opt_out)
    report = lc.compact_partitions(uri, ["source"], target_rows=1000)
    assert deleted == [1] and report.removed > 0
    assert content(uri, "a") == [r for r in content_of(rows("a", 40)) if r[0] != "a/3"]
    assert content(uri, "b") == content_of(rows("b", 40))
    assert all(len(s) == 1 for s in sources_per_fragment(uri))

BLOBS = pa.schema([("source", pa.string()), ("key", pa.int64()), ("image", pa.large_binary())])


def blob_table(uri: str, source: str, fragments: int, rows: int = 20, size: int = 20_000) -> int:
    """`fragments` fragments of `rows` rows of `size`-byte blobs each; the bytes of one fragment."""
    for n in range(fragments):
        data = pa.table({"source": [source] * rows, "key": list(range(n * rows, (n + 1) * rows)),
                         "image": [random.randbytes(size) for _ in range(rows)]}, schema=BLOBS)  # incompressible
        lio.replace_rows(uri, "", lio.write_fragments(uri, data, BLOBS), BLOBS)
    return lc.fragment_bytes(lance.dataset(uri).get_fragments()[0].metadata)


def test_blob_fragments_near_the_byte_target_are_not_rewritten(tmp_path: Path) -> None:
    """20 rows of 20 KB are "small" by rows (target 1,000) but over half the byte target: a samples
    fragment of 168k photos is the same case at PRX scale, and was rewritten every night."""
    uri = str(tmp_path / "blobs.lance")
    one = blob_table(uri, "a", 4)
    plan, _ = lc.plan_compaction(lance.dataset(uri), ["source"], target_rows=1000, target_bytes=int(1.5 * one))
    assert plan == {}
    report = lc.compact_partitions(uri, ["source"], target_rows=1000, target_bytes=int(1.5 * one))
    assert (report.removed, report.written) == (0, 0) and len(lance.dataset(uri).get_fragments()) == 4
    plan, _ = lc.plan_compaction(lance.dataset(uri), ["source"], target_rows=1000, target_bytes=10 * one)
    assert plan == {("a",): [[0, 1, 2, 3]]}  # small by bytes too: merged


def test_a_partition_is_rewritten_in_groups_of_one_target_fragment(tmp_path: Path) -> None:
    uri = str(tmp_path / "groups.lance")
    one = blob_table(uri, "a", 8)
    before = lio.read_table(uri).sort_by("key")
    target = int(3.5 * one)  # three fragments per group: 3 + 3 + 2
    plan, _ = lc.plan_compaction(lance.dataset(uri), ["source"], target_rows=1000, target_bytes=target)
    assert plan == {("a",): [[0, 1, 2], [3, 4, 5], [6, 7]]}
    report = lc.compact_partitions(uri, ["source"], target_rows=1000, target_bytes=target)
    assert (report.groups, report.groups_failed, report.removed, report.written) == (3, 0, 8, 3)
    assert lio.read_table(uri).sort_by("key").equals(before)
    assert all(lc.fragment_bytes(f.metadata) <= target for f in lance.dataset(uri).get_fragments())
    again = lc.compact_partitions(uri, ["source"], target_rows=1000, target_bytes=target)
    assert (again.removed, again.written) == (0, 0)  # each fragment now near the target: left alone


def test_partition_keys_are_read_by_tasks_the_same_as_here(tmp_path: Path) -> None:
    """Planning reads each fragment's partition keys in Ray tasks of a few fragments each (round
    trips on an object store); they find what a read in this process finds, a mixed fragment's too."""
    uri = str(tmp_path / "t.lance")
    build(uri, "ab", n=40, per_file=10)
    lc.compact_table(uri, target_rows_per_fragment=1000)  # one fragment holding both sources
    build(uri, "c", n=60, per_file=5)
    ds = lance.dataset(uri)
    ids = [f.fragment_id for f in ds.get_fragments()]
    here = lc.partition_keys_of(ds, ids, ["source"], per_task=len(ids))  # one call's worth: no tasks
    assert len(ids) == 13 and sorted(map(sorted, here.values())) == [[("a",), ("b",)]] + [[("c",)]] * 12
    assert on_cluster() and lc.partition_keys_of(ds, ids, ["source"], per_task=4) == here  # 4 Ray tasks
