"""Connected components of a graph too big for one process, on Ray: the Two-Phase algorithm of
Kiveris et al. ("Connected Components in MapReduce and Beyond", SoCC 2014).

Nodes are uint64 ids; edges live in the object store as parts of (n, 2) uint64 arrays, one part
per (task, bucket), each directed edge in the bucket of its first node. A round is one layer of
tasks, one per bucket, that groups its edges by node and rewrites them (Large-Star, then
Small-Star); after O(log^2 n) rounds (3-4 for the few-node components of duplicates) every
component is a star around its smallest node, and a node's label is that node. The driver holds
object references, never edges: per round one reference per (bucket, bucket) and a digest per
bucket, by which it sees that a round changed nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

MAX_ROUNDS = 64  # a pair of rounds at least halves the hops to the minimum: far above any real need
EMPTY = np.empty((0, 2), np.uint64)


def both_ways(edges: np.ndarray) -> np.ndarray:
    """Each undirected edge as its two directed edges, without self-loops."""
    edges = edges[edges[:, 0] != edges[:, 1]]
    return np.concatenate([edges, edges[:, ::-1]])


def split_edges(edges: np.ndarray, buckets: int) -> tuple[np.ndarray, ...]:
    """Directed edges by `first % buckets`."""
    bucket = edges[:, 0] % np.uint64(buckets)
    return tuple(edges[bucket == b] for b in range(buckets))


def star(edges: np.ndarray, large: bool) -> np.ndarray:
    """One Large-Star (`large`) or Small-Star step over directed edges grouped by their first node
    (all of each node's edges are here): the new undirected edges, each (node, its new parent)."""
    if len(edges) == 0:
        return EMPTY
    edges = np.unique(edges, axis=0)
    nodes, starts = np.unique(edges[:, 0], return_index=True)
    minimum = np.minimum(nodes, np.minimum.reduceat(edges[:, 1], starts))  # of the node and its neighbours
    parent = minimum[np.searchsorted(nodes, edges[:, 0])]
    if large:  # neighbours above the node hang from the smallest of its neighbourhood
        keep = edges[:, 1] > edges[:, 0]
        return np.column_stack([edges[keep, 1], parent[keep]])
    below = edges[edges[:, 1] <= edges[:, 0]]  # Small-Star: the node and its neighbours below it
    if len(below) == 0:
        return EMPTY
    low_nodes, low_starts = np.unique(below[:, 0], return_index=True)
    low_min = np.minimum(low_nodes, np.minimum.reduceat(below[:, 1], low_starts))
    low_parent = low_min[np.searchsorted(low_nodes, below[:, 0])]
    return np.concatenate([np.column_stack([below[:, 1], low_parent]), np.column_stack([low_nodes, low_min])])


def digest(edges: np.ndarray) -> int:
    """An order-free digest of a set of directed edges (unique rows)."""
    if len(edges) == 0:
        return 0
    with np.errstate(over="ignore"):
        mixed = (edges[:, 0] * np.uint64(0x9E3779B97F4A7C15)) ^ (edges[:, 1] + np.uint64(0xBF58476D1CE4E5B9))
        mixed ^= mixed >> np.uint64(29)
        return int(np.sum(mixed * np.uint64(0x94D049BB133111EB), dtype=np.uint64))


def _round(refs: Sequence[Any], buckets: int, large: bool) -> tuple[Any, ...]:
    """Ray task: one bucket's edges through one step; returns the next layer's parts and the digest
    of this bucket's (deduplicated) input."""
    import ray

    parts = [p for p in ray.get(list(refs)) if len(p)]
    edges = np.unique(np.concatenate(parts), axis=0) if parts else EMPTY
    out = split_edges(both_ways(star(edges, large)), buckets)
    return (*out, digest(edges)) if buckets > 1 else (out[0], digest(edges))


def _labels(refs: Sequence[Any]) -> np.ndarray:
    """Ray task: (node, label) of one bucket's nodes once every component is a star."""
    import ray

    parts = [p for p in ray.get(list(refs)) if len(p)]
    return _star_labels(np.unique(np.concatenate(parts), axis=0)) if parts else EMPTY


def connected_components(edge_parts: Sequence[Sequence[Any]], buckets: int,
                         max_rounds: int = MAX_ROUNDS) -> tuple[list[Any], int]:
    """Label every node of the undirected edges in `edge_parts` (per bucket, refs of (n, 2) uint64
    arrays of directed edges whose first node falls in that bucket, both directions present) with
    the smallest node of its component. Returns one ref per bucket of (n, 2) (node, label) arrays,
    and the rounds it took."""
    import ray

    task = ray.remote(_round).options(num_returns=buckets + 1)
    layer = [list(refs) for refs in edge_parts]
    previous = None
    for rounds in range(1, max_rounds + 1):
        outputs = [task.remote(layer[b], buckets, rounds % 2 == 1) for b in range(buckets)]
        current = sum(ray.get([out[buckets] for out in outputs])) & (2**64 - 1)
        if rounds % 2 == 1 and current == previous:  # a Large+Small pair changed nothing
            return [ray.remote(_labels).remote(layer[b]) for b in range(buckets)], rounds
        if rounds % 2 == 1:
            previous = current
        layer = [[out[b] for out in outputs] for b in range(buckets)]
    raise RuntimeError(f"connected components did not converge in {max_rounds} rounds")


def local_components(edges: np.ndarray, max_rounds: int = MAX_ROUNDS) -> np.ndarray:
    """`connected_components` in one process (tests, small sets): (node, label) rows."""
    layer = np.unique(both_ways(np.asarray(edges, np.uint64).reshape(-1, 2)), axis=0)
    for rounds in range(max_rounds):
        pair = both_ways(star(both_ways(star(layer, large=True)), large=False))
        pair = np.unique(pair, axis=0) if len(pair) else EMPTY
        if digest(pair) == digest(layer):
            break
        layer = pair
    else:
        raise RuntimeError(f"connected components did not converge in {max_rounds} rounds")
    return _star_labels(layer)


def _star_labels(edges: np.ndarray) -> np.ndarray:
    if len(edges) == 0:
        return EMPTY
    nodes, starts = np.unique(edges[:, 0], return_index=True)
    return np.column_stack([nodes, np.minimum(nodes, np.minimum.reduceat(edges[:, 1], starts))])
