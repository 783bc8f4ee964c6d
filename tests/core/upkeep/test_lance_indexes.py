"""Lance indexes on real tables: full-text, vector and BITMAP (partition columns) indexes are
created once, caught up after writes, survive compaction and answer queries; an index refresh
that loses a commit race is a note, not a failure."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from test_lance_io import SCHEMA, content, content_of, rows, where

from prx_core.store import lance_io as lio
from prx_core.store import maintenance as maint
from prx_core.store import schemas
from prx_core.upkeep import compaction


def embedded_rows(source: str, n: int, dim: int, seed: int) -> pa.Table:
    table = rows(source, n)
    vectors = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return table.append_column("emb", pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel()), dim))


def test_indexes_refresh_and_survive_compaction(tmp_path: Path) -> None:
    uri, dim = str(tmp_path / "explore.lance"), 16
    tables = {s: embedded_rows(s, 200, dim, seed) for seed, s in enumerate("ab")}
    captions = tables["a"]["caption"].to_pylist()
    captions[17] = "a neon sign reading zanzibar over a door"
    tables["a"] = tables["a"].set_column(3, "caption", pa.array(captions))
    schema = tables["a"].schema
    for source, table in tables.items():
        lio.replace_partition(uri, where(source), table, schema)
    report = maint.refresh_indexes(uri, ["caption"], "emb")
    assert report.created == ["caption_fts", "emb_vector"] and report.indexes == ["caption_fts", "emb_vector"]
    version = lio.table_version(uri)
    assert maint.refresh_indexes(uri, ["caption"], "emb").created == [] and lio.table_version(uri) == version
    planted = tables["a"]["emb"][42].values.to_numpy()

    def check() -> None:
        ds = lio.require_table(uri)
        hits = ds.to_table(full_text_query={"columns": ["caption"], "query": "zanzibar"}, columns=["sample_id"])
        assert hits["sample_id"].to_pylist() == ["a/17"]
        near = ds.to_table(nearest={"column": "emb", "q": planted, "k": 3}, columns=["sample_id"])
        assert near["sample_id"][0].as_py() == "a/42"

    check()
    lio.replace_partition(uri, where("b"), embedded_rows("b", 300, dim, 7), schema)  # unindexed rows
    assert maint.refresh_indexes(uri, ["caption"], "emb").optimized == ["caption_fts", "emb_vector"]
    check()
    lio.replace_partition(uri, where("b"), embedded_rows("b", 250, dim, 8), schema)  # unindexed again
    report = compaction.compact_table(uri, target_rows_per_fragment=10_000, cleanup_older_than=timedelta(0))
    assert report.fragments_after == 1  # indexes caught up first, or Lance keeps fragments apart
    assert maint.refresh_indexes(uri, ["caption"], "emb") == maint.IndexReport(
        indexes=["caption_fts", "emb_vector"], created=[], optimized=[], notes=[], version=lio.table_version(uri))
    check()
    assert lio.read_table(uri, ["sample_id"], where("b")).num_rows == 250


def test_partition_tables_find_a_partition_through_a_bitmap_index(tmp_path: Path) -> None:
    uri = str(tmp_path / "mds_index.lance")
    for source in "abc":
        lio.replace_partition(uri, where(source), rows(source, 20), SCHEMA)
    report = maint.refresh_table_indexes(uri, "mds_index")
    assert report.created == ["source_bitmap", "sample_id_btree"] and report.version == lio.table_version(uri)
    plan = lio.require_table(uri).scanner(filter=where("b"), columns=["sample_id"]).explain_plan()
    assert "ScalarIndexQuery" in plan and "source_bitmap" in plan, plan
    lio.replace_partition(uri, where("b"), rows("b", 5, "v2"), SCHEMA)  # unindexed fragment: caught up
    assert sorted(maint.refresh_table_indexes(uri, "mds_index").optimized) == ["sample_id_btree", "source_bitmap"]
    assert content(uri, "b") == content_of(rows("b", 5, "v2"))
    assert maint.refresh_indexes(uri, btree_columns=["sample_id"]).indexes == ["sample_id_btree", "source_bitmap"]


def test_an_index_refresh_that_loses_a_race_is_a_note(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lance.commit import CommitConflictError

    uri = str(tmp_path / "raced.lance")
    lio.replace_partition(uri, where("a"), rows("a", 3), SCHEMA)

    def conflict(*args, **kwargs):
        raise CommitConflictError("another writer committed first")

    monkeypatch.setattr(maint, "refresh_indexes", conflict)
    report = maint.refresh_table_indexes(uri, "samples")
    assert "lost a commit race" in report.notes[0] and report.version == lio.table_version(uri)

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(maint, "refresh_indexes", broken)
    with pytest.raises(OSError, match="disk full"):  # anything else is still an error
        maint.refresh_table_indexes(uri, "samples")


def test_vector_index_rules(tmp_path: Path) -> None:
    small = str(tmp_path / "small.lance")
    lio.replace_partition(small, where("a"), embedded_rows("a", 50, 8, 0), embedded_rows("a", 1, 8, 0).schema)
    report = maint.refresh_indexes(small, [], "emb")
    assert report.indexes == [] and "skipped" in report.notes[0]
    ragged = str(tmp_path / "ragged.lance")
    lio.overwrite(ragged, pa.table({"emb": pa.array([[1.0, 2.0], [3.0]], pa.list_(pa.float32()))}))
    with pytest.raises(ValueError, match="fixed_size_list"):
        maint.refresh_indexes(ragged, [], "emb")
    pq = str(tmp_path / "pq.lance")
    table = embedded_rows("a", 300, 16, 1)
    lio.replace_partition(pq, where("a"), table, table.schema)
    assert maint.refresh_indexes(pq, [], "emb", pq_min_rows=256).created == ["emb_vector"]
    assert lio.require_table(pq).describe_indices()[0].index_type == "IVF_PQ"


def test_a_run_merges_only_the_newest_segments_within_its_row_budget(tmp_path: Path) -> None:
    """A stage commit leaves a full-text delta of its own; compaction folds the newest (small)
    segments, within its row budget and the size-ratio bound, and leaves the big old one as it is.
    The BTREE index is bounded at every catch-up (prx_core.store.segments): each stage commit folds
    its rows into the newest small segment, never into the 300-row one."""
    uri = str(tmp_path / "segments.lance")
    lio.replace_partition(uri, where("a"), rows("a", 300), SCHEMA)
    maint.refresh_indexes(uri, ["caption"], btree_columns=["sample_id"])
    for n, source in enumerate("bcd"):  # three stage commits: a delta segment each
        lio.replace_partition(uri, where(source), rows(source, 10 + n), SCHEMA)
        maint.refresh_indexes(uri, ["caption"], btree_columns=["sample_id"], merge_rows=0)

    def segments() -> dict[str, list[int]]:
        return {d.name: [sum(1 for _ in s.fragment_ids) for s in d.segments] for d in lio.require_table(uri).describe_indices()}

    base = {d.name: sorted(d.segments[0].fragment_ids) for d in lio.require_table(uri).describe_indices()}
    assert segments() == {"caption_fts": [1, 1, 1, 1], "sample_id_btree": [1, 3]}
    report = maint.refresh_indexes(uri, ["caption"], btree_columns=["sample_id"], merge_rows=100)
    assert report.optimized == ["caption_fts"]
    assert segments() == {"caption_fts": [1, 3], "sample_id_btree": [1, 3]}  # 10 + 11 + 12 rows fit 100; 300 do not
    assert {d.name: sorted(d.segments[0].fragment_ids) for d in lio.require_table(uri).describe_indices()} == base
    version = lio.table_version(uri)
    assert maint.refresh_indexes(uri, ["caption"], btree_columns=["sample_id"], merge_rows=100).optimized == []
    assert lio.table_version(uri) == version  # nothing left within the budget: no commit
    ds = lio.require_table(uri)
    hits = ds.to_table(full_text_query={"columns": ["caption"], "query": "caption"}, columns=["sample_id"])
    assert hits.num_rows == 333  # every row still found through the two segments


def test_retired_indexes_are_dropped_and_the_kept_ones_built(tmp_path: Path) -> None:
    """An older corpus's `explorer` had one INVERTED index per caption; the refresh drops them (else
    every commit extends them) and builds the one over `search_text`."""
    uri = str(tmp_path / "explorer.lance")
    texts = [("a red car", "car.jpg", "a red car car.jpg"), ("a cat", None, "a cat"), (None, "zebra", "zebra")]
    lio.overwrite(uri, pa.Table.from_pylist([{"sample_id": f"s/{i}", "source": "s", "caption": c, "original_caption": o,
                                              "search_text": t} for i, (c, o, t) in enumerate(texts)], schemas.EXPLORER))
    maint.refresh_indexes(uri, ["caption", "original_caption"])  # what an older version kept
    assert maint.drop_retired_indexes(uri, "explorer") == ["caption_fts", "original_caption_fts"]
    assert maint.drop_retired_indexes(uri, "explorer") == []
    maint.refresh_indexes(uri, ["caption", "original_caption"])
    report = maint.refresh_table_indexes(uri, "explorer")
    assert "search_text_fts" in report.created and not {"caption_fts", "original_caption_fts"} & set(report.indexes)
    hits = lio.require_table(uri).to_table(full_text_query={"columns": ["search_text"], "query": "zebra"})
    assert hits["caption"].to_pylist() == [None]
