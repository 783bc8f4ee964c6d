"""The pure parts of `duplicates`: candidate pairs (copy classes chained, over-common keys left
out), groups cut around keepers (best copy first, members confirmed with the keeper itself, a
chain split), connected components, and the Bloom filter an incremental run ships."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from dup_rows import phash_rows, picture_signature

from prx_core.compute.bloom import Bloom
from prx_core.compute.components import local_components
from prx_core.stages.duplicates.groups import (
    NODE_COLUMNS,
    candidate_pairs,
    colour_means,
    compatible,
    confirmed,
    find_duplicates,
    group_component,
)
from prx_core.store import schemas


def test_copy_classes_are_chained_and_distinct_classes_paired() -> None:
    keys = np.array([5, 5, 5, 5, 9, 9], np.uint64)
    nodes = np.array([1, 2, 3, 4, 4, 6], np.uint64)
    exact = np.array([7, 7, 7, 8, 8, 3], np.uint64)  # 1, 2, 3 are one copy class
    pairs, skipped = candidate_pairs(keys, nodes, exact)
    assert pairs.tolist() == [[1, 2], [1, 3], [1, 4], [4, 6]] and skipped == 0


def test_a_key_held_by_many_classes_pairs_each_with_its_luma_neighbours_only() -> None:
    """A common key's classes (a top-8 set at a billion rows) are paired within the luma a
    confirmation allows, each with at most `max_classes` next ones; its copies still chain."""
    n = 40
    keys = np.full(n + 3, 42, np.uint64)
    nodes = np.arange(n + 3, dtype=np.uint64)
    exact = np.r_[np.arange(n), [99, 99, 99]].astype(np.uint64)
    luma = np.r_[np.arange(n) * 10 % 250, [7, 7, 7]].astype(np.uint64)  # 4 and 28 share luma 40 (and 200)
    means = luma << np.uint64(16) | np.uint64(128 << 8 | 128)
    pairs, cut = candidate_pairs(keys, nodes, exact, means, max_classes=4)
    assert {(40, 41), (40, 42)} <= set(map(tuple, pairs.tolist()))  # the copy class, chained
    luma_of = dict(zip(nodes.tolist(), luma.tolist()))
    assert all(abs(luma_of[a] - luma_of[b]) <= 3 for a, b in pairs.tolist())
    assert (4, 29) in set(map(tuple, pairs.tolist())) and cut == 0
    crowded = np.full(n, 100, np.uint64) << np.uint64(16)  # every class the same colour: more than the window
    pairs, cut = candidate_pairs(keys[:n], nodes[:n], exact[:n], crowded, max_classes=4)
    assert len(pairs) == 4 * n - 10 and cut == n - 5  # each class with its 4 next ones, never all with all


def test_colour_means_drop_chance_meetings_but_never_a_pair_the_signatures_confirm() -> None:
    rng = np.random.default_rng(5)
    base = np.frombuffer(b"".join(picture_signature(p) for p in range(400)), np.uint8).reshape(400, -1)
    shift = rng.integers(-6, 7, (400, 1)) * (rng.random((400, 1)) < 0.5)  # brighter or tinted copies, some not
    chroma = np.zeros_like(base, np.int16)
    chroma[:, 256:] = rng.integers(-6, 7, (400, 1)) * (rng.random((400, 1)) < 0.5)
    noisy = np.clip(base.astype(np.int16) + shift * (np.arange(base.shape[1]) < 256) + chroma +
                    rng.integers(-1, 2, base.shape), 0, 255).astype(np.uint8)
    ok, _ = confirmed(base, noisy)
    allowed = compatible(colour_means(base), colour_means(noisy))
    assert ok.any() and (~ok).any() and not (ok & ~allowed).any()
    strangers = compatible(colour_means(base[:-1]), colour_means(base[1:]))
    assert strangers.mean() < 0.05  # different pictures rarely pass


def rows_of(items: list[tuple]) -> pa.Table:
    return phash_rows("s", items).select(NODE_COLUMNS)


def test_the_keeper_is_the_largest_then_lossless_then_quality_then_bytes_then_id() -> None:
    items = [("b", 7, 0, 100, 95, 10), ("a", 7, 1, 400, 75, 50), ("c", 7, 2, 400, 92, 40),  # size, then quality
             ("e", 11, 0, 10, 90, 10), ("f", 11, 1, 10, 90, 10),  # all equal: the smallest sample_id
             ("g", 13, 0, 10, 80, 10), ("h", 13, 1, 10, 80, 30), ("i", 13, 2, 10, None, 5, True),  # lossless first
             ("j", 13, 3, 10, None, 90)]  # a lossy file without a JPEG quality ranks below every JPEG
    table = phash_rows("s", items)
    first = find_duplicates(table)
    again = find_duplicates(table.take(list(reversed(range(len(items))))))
    assert sorted(first.to_pylist(), key=str) == sorted(again.to_pylist(), key=str)  # read order never matters
    keepers = {r["sample_id"]: r["keeper_sample_id"] for r in first.to_pylist()}
    assert keepers == {"s/a": "s/c", "s/b": "s/c", "s/c": "s/c", "s/e": "s/e", "s/f": "s/e",
                       "s/g": "s/i", "s/h": "s/i", "s/i": "s/i", "s/j": "s/i"}
    assert set(first["group_size"].to_pylist()) == {3, 2, 4}
    assert pc.all(pc.equal(first.filter(first["keeper"])["signature_distance"], 0)).as_py()


def test_a_chain_of_copies_is_cut_where_the_ends_differ() -> None:
    """a ~ b and b ~ c but a and c differ: a keeps b; c is confirmed with no keeper above it and
    keeps itself, in the same component."""
    base = np.frombuffer(picture_signature(1), np.uint8).astype(np.int16)
    step = np.zeros_like(base)
    step[:256] = np.where(np.arange(256) % 2, 4, -4)  # structure that drifts
    sigs = [np.clip(base + k * step, 0, 255).astype(np.uint8).tobytes() for k in (0, 1, 2)]
    rows = pa.table({"sample_id": ["a", "b", "c"], "source": ["s"] * 3, "phash": pa.array([1, 1, 1], pa.uint64()),
                     "pixels": [300, 200, 100], "lossless": [False] * 3, "jpeg_quality": pa.array([90] * 3, pa.int16()),
                     "num_bytes": [1, 1, 1], "signature": pa.array(sigs, pa.binary())})
    groups = {r["sample_id"]: r for r in group_component(rows).to_pylist()}
    assert groups["b"]["keeper_sample_id"] == "a" and groups["c"]["keeper_sample_id"] == "c"
    assert groups["c"]["group_size"] == 1 and groups["a"]["group_size"] == 2
    assert len({r["component_id"] for r in groups.values()}) == 1
    assert groups["b"]["signature_distance"] <= 1


def test_lookalikes_share_a_key_but_never_a_group() -> None:
    table = phash_rows("s", [("x", 3, 0, 10, 90, 1), ("y", 1003, 0, 10, 90, 1)])  # 1003 shares picture 3's first key
    assert find_duplicates(table).num_rows == 0
    assert find_duplicates(table.slice(0, 0)).schema.equals(schemas.DUPLICATES)


@pytest.mark.parametrize("seed", range(4))
def test_components_equal_union_find(seed: int) -> None:
    rng = np.random.default_rng(seed)
    edges = rng.integers(0, 3000, (2000, 2)).astype(np.uint64) * np.uint64(2**40)  # ids far above 2^32
    labels = dict(local_components(edges).tolist())
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in edges.tolist():
        if a != b:
            ra, rb = find(a), find(b)
            parent[max(ra, rb)] = min(ra, rb)
    members: dict[int, list[int]] = {}
    for node in {n for e in edges.tolist() for n in e if e[0] != e[1]}:
        members.setdefault(find(node), []).append(node)
    assert labels == {n: min(group) for group in members.values() for n in group}


def test_components_on_ray_equal_the_local_ones(ray_cluster) -> None:
    import ray

    from prx_core.compute.components import both_ways, connected_components, split_edges

    edges = np.random.default_rng(9).integers(0, 500, (400, 2)).astype(np.uint64)
    buckets = 5
    parts = [[ray.put(p)] for p in split_edges(both_ways(edges), buckets)]
    refs, rounds = connected_components(parts, buckets)
    got = np.concatenate([r for r in ray.get(refs) if len(r)])
    assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, local_components(edges).tolist())) and rounds >= 3


def test_the_bloom_filter_has_no_false_negatives_and_few_false_positives() -> None:
    rng = np.random.default_rng(1)
    held, other = rng.integers(0, 2**63, 20_000).astype(np.uint64), rng.integers(0, 2**63, 100_000).astype(np.uint64)
    bloom = Bloom.sized(len(held))
    bloom.add(held)
    assert bloom.contains(held).all()
    assert bloom.contains(other).mean() < 0.02
    half = Bloom(np.zeros_like(bloom.words))
    half.add(held[:10])
    assert half.union(bloom).contains(held).all()
