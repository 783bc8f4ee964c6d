"""Bounded index segments (prx_core.store.segments): the pure policy over many histories keeps an
index within its bound at a few rewrites per row, and on real Lance tables many small appends with
catch-ups keep a BTREE index within the bound while every key is still found, exactly."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import lance
import pyarrow as pa
import pytest

from prx_core.store import maintenance as maint
from prx_core.store.segments import MAX_SEGMENTS, fold, rewrites, segments_to_merge

HISTORIES = {
    "equal": [1_000] * 1_000,
    "growing": [10 * (i + 1) for i in range(400)],
    "shrinking": [100_000 // (i + 1) + 1 for i in range(400)],
    "bursty": [random.Random(7).choice((1, 10, 100, 10_000)) for _ in range(600)],
    "one_big_then_small": [10_000_000] + [1_000] * 500,
}


@pytest.mark.parametrize("history", sorted(HISTORIES))
@pytest.mark.parametrize("bound", [1, 2, 3, 8, 16])
def test_no_history_leaves_more_segments_than_the_bound(history: str, bound: int) -> None:
    sizes, most, total, worst = rewrites(HISTORIES[history], bound)
    assert most <= bound and sum(sizes) == sum(HISTORIES[history])
    assert worst <= sum(HISTORIES[history])  # one catch-up rewrites at most the whole index


@pytest.mark.parametrize("catch_ups, bound, most_segments, rewrites_per_row",
                         [(100, 8, 3, 6.5), (1_000, 8, 5, 9.6), (16_000, 8, 7, 13.6), (1_000, 16, 5, 9.6)])
def test_equal_catch_ups_rewrite_each_row_a_few_times(catch_ups: int, bound: int, most_segments: int,
                                                      rewrites_per_row: float) -> None:
    """The cost bound, amortized: the size-ratio rule rewrites each row a few times over a
    table's history (the old 'merge the newest within a budget' rewrote each ~3 times but left
    a segment per 10 catch-ups), and the hard bound is seldom what merges."""
    sizes, most, total, _ = rewrites([1_000_000] * catch_ups, bound)
    assert most <= most_segments <= bound
    assert total / sum(sizes) <= rewrites_per_row


def test_merging_whatever_the_sizes_alone_would_rewrite_the_newest_segment_at_every_catch_up() -> None:
    """Why the ratio rule: at the bound, every catch-up must fold into the newest segment, which
    then only grows; the ratio rule keeps the policy off the bound."""
    capped_only = [0] * 8 + [1] * 992  # what 'merge when over the bound' alone folds, 1,000 equal catch-ups
    sizes: list[int] = []
    total = 0
    for take in capped_only:
        sizes, cost = fold(sizes, 1, take)
        total += cost
    assert len(sizes) == 8 and total / 1_000 > 400  # each row rewritten ~490 times
    assert rewrites([1] * 1_000, 8)[2] / 1_000 < 10


@pytest.mark.parametrize("sizes, new_rows, bound, take", [
    ([], 100, 8, 0),  # a first segment
    ([], 0, 8, 0),
    ([1_000], 0, 8, 0),  # nothing new, one segment: nothing to fold
    ([1_000, 10], 0, 8, 0),  # nothing new, the newest far smaller than the one before: leave them
    ([1_000, 990], 0, 8, 2),  # nothing new, two alike: fold them
    ([1_000_000], 10, 8, 0),  # a small delta beside a big segment: a segment of its own
    ([1_000_000, 10], 10, 8, 1),  # two small ones fold, never into the big one
    ([100] * 8, 100, 8, 8),  # alike sizes cascade into one
    ([10 ** 9, 10 ** 8, 10 ** 7, 10 ** 6, 10 ** 5, 10 ** 4, 10 ** 3, 100], 10, 8, 1),  # at the bound: fold the newest
    ([10 ** 9, 10 ** 8, 10 ** 7, 10 ** 6, 10 ** 5, 10 ** 4, 10 ** 3, 100, 10], 0, 8, 2),  # over it, nothing new
    ([10 ** 9, 10 ** 8, 10 ** 7, 10 ** 6, 10 ** 5, 10 ** 4], 1, 8, 0),  # a tiny delta never cascades
    ([10 ** 9, 3 * 10 ** 8, 10 ** 8, 3 * 10 ** 7], 10 ** 7, 8, 4),  # spaced under 4x: a cascade to the oldest
    ([5, 5, 5], 5, 1, 3),  # a bound of one: everything, always
    ([0, 0], 10, 8, 2),  # segments of deleted fragments fold away with the new rows
])
def test_segments_to_merge_edge_cases(sizes: list[int], new_rows: int, bound: int, take: int) -> None:
    assert segments_to_merge(sizes, new_rows, bound) == take


def test_a_bound_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        segments_to_merge([1], 1, 0)


def content_ids(start: int, n: int) -> list[str]:
    """Keys as the pipeline makes them (prx_core.sources.ingest.content_id: SHA-256 hex of bytes)."""
    return [hashlib.sha256(f"image-{i}".encode()).hexdigest() for i in range(start, start + n)]


def segment_sizes(uri: str, name: str) -> list[int]:
    ds = lance.dataset(uri)
    rows = {f.fragment_id: f.count_rows() for f in ds.get_fragments()}
    desc = next(d for d in ds.describe_indices() if d.name == name)
    return [sum(rows.get(i, 0) for i in s.fragment_ids) for s in desc.segments]


@pytest.mark.parametrize("bound", [3, 8])
def test_many_small_appends_keep_a_btree_within_the_bound_and_find_every_key(tmp_path: Path, bound: int) -> None:
    uri, batch, appends = str(tmp_path / "keys.lance"), 200, 40
    lance.write_dataset(pa.table({"content_id": content_ids(0, batch), "n": list(range(batch))}), uri)
    lance.dataset(uri).create_scalar_index("content_id", "BTREE", name="content_id_btree")
    most = 1
    for a in range(1, appends):
        keys = content_ids(a * batch, batch)
        ds = lance.write_dataset(pa.table({"content_id": keys, "n": list(range(a * batch, (a + 1) * batch))}),
                                 uri, mode="append")
        maint.catch_up_indexes(ds, ["content_id_btree"], merge_rows=0, max_segments=bound)
        sizes = segment_sizes(uri, "content_id_btree")
        most = max(most, len(sizes))
        assert len(sizes) <= bound and sum(sizes) == (a + 1) * batch  # every row indexed, within the bound
    assert most >= 3  # each catch-up left a delta of its own before: 40 segments
    ds = lance.dataset(uri)
    every = content_ids(0, appends * batch)
    probe = random.Random(3).sample(range(len(every)), 300)
    found = ds.to_table(filter=maint_in([every[i] for i in probe]), columns=["content_id", "n"])
    assert sorted(zip(found["content_id"].to_pylist(), found["n"].to_pylist())) == sorted((every[i], i) for i in probe)
    assert "ScalarIndexQuery" in ds.scanner(filter=maint_in(every[:5])).explain_plan()
    missing = ds.to_table(filter=maint_in(content_ids(10 ** 7, 5)), columns=["content_id"])
    assert missing.num_rows == 0


def maint_in(keys: list[str]) -> str:
    from prx_core.upkeep.appends import keys_predicate

    return keys_predicate("content_id", keys)


def test_the_default_bound_is_what_catch_ups_use() -> None:
    import inspect

    assert inspect.signature(maint.catch_up_indexes).parameters["max_segments"].default == MAX_SEGMENTS


def test_a_full_text_index_gains_deltas_in_the_stages_and_maintenance_folds_them_within_the_bound(
        tmp_path: Path) -> None:
    """Stage catch-ups (`merge_rows=0`) leave a full-text delta per commit, never a big merge in a
    commit; a maintenance catch-up (compaction's, `merge_rows` > 0) folds them to the bound, and
    every caption is still found by its words."""
    uri, batch, appends, bound = str(tmp_path / "captions.lance"), 50, 12, 3

    def rows(a: int) -> pa.Table:
        return pa.table({"n": list(range(a * batch, (a + 1) * batch)),
                         "caption": [f"a photo of thing{i} near word{i % 7}" for i in range(a * batch, (a + 1) * batch)]})

    lance.write_dataset(rows(0), uri)
    lance.dataset(uri).create_scalar_index("caption", "INVERTED", name="caption_fts")
    for a in range(1, appends):
        ds = lance.write_dataset(rows(a), uri, mode="append")
        maint.catch_up_indexes(ds, ["caption_fts"], merge_rows=0, max_segments=bound)
    assert len(segment_sizes(uri, "caption_fts")) == appends  # a delta per commit
    maint.catch_up_indexes(lance.dataset(uri), ["caption_fts"], merge_rows=1, max_segments=bound)
    sizes = segment_sizes(uri, "caption_fts")
    assert len(sizes) <= bound and sum(sizes) == appends * batch
    ds = lance.dataset(uri)
    for i in random.Random(5).sample(range(appends * batch), 20):
        hits = ds.to_table(full_text_query=f"thing{i}", columns=["n"])["n"].to_pylist()
        assert hits == [i], (i, hits)
