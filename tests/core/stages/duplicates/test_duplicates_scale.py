"""`duplicates` at PRX sizes, from its planning functions (no data): at a billion rows the driver holds
a bounded number of object references, the largest task sorts about a GiB of key entries, and the
work grows linearly with the rows. What each layer holds at run time on real rows is measured by
`prx-bench scale` (the driver's peak RSS, tests/benchmarks/test_scale_bench.py); the candidates a key
meets by chance among real photos are in docs/benchmarks.md."""

from __future__ import annotations

import numpy as np
import pytest

from prx_core.compute.groupby import BUCKET_ROWS
from prx_core.compute.units import Unit
from prx_core.stages.duplicates.groups import candidate_pairs
from prx_core.stages.duplicates.runs import ENTRY_BYTES, KEYS_PER_ROW, shuffle_plan

FRAGMENT_ROWS = 1_000_000  # phashes fragments as ingest and compaction keep them


def plan(rows: int):
    units = [Unit(f"f{i:07d}", FRAGMENT_ROWS, {"fragment": i}) for i in range(-(-rows // FRAGMENT_ROWS))]
    return shuffle_plan(units, BUCKET_ROWS)[0]


@pytest.mark.parametrize("rows", [10**7, 10**8, 10**9])
def test_the_driver_holds_a_bounded_number_of_references_whatever_the_rows(rows: int) -> None:
    shuffle = plan(rows)
    assert shuffle.driver_refs <= 300_000  # ~100 B each in the driver: tens of MB, never rows
    assert shuffle.bytes_per_bucket <= 1.1 * 2**30  # the largest task: one bucket's key entries


def test_the_work_grows_linearly_with_the_rows() -> None:
    small, large = plan(10**8), plan(10**9)
    assert large.entries == 10 * small.entries == 10**9 * KEYS_PER_ROW  # every row's keys, once
    assert large.map_tasks == 10 * small.map_tasks  # map tasks follow the rows
    assert large.buckets == small.buckets == 256 and large.bytes_per_bucket <= 10.1 * small.bytes_per_bucket


def test_a_bucket_of_random_keys_meets_no_chance_candidate() -> None:
    """A pair task's bucket at a billion rows holds ~27M entries; a slice of it with keys drawn as
    uniformly as top-k sets of distinct photos are (docs/benchmarks.md) pairs only the planted copies."""
    rng = np.random.default_rng(3)
    n = 200_000
    keys = rng.integers(1, 2**63, n, dtype=np.uint64)
    nodes = np.arange(n, dtype=np.uint64)
    keys[1::1000] = keys[::1000][: len(keys[1::1000])]  # 200 planted copies share a key with their original
    pairs, skipped = candidate_pairs(keys, nodes, nodes.copy())
    assert len(pairs) == 200 and skipped == 0
    assert (pairs[:, 1] - pairs[:, 0] == 1).all() and ENTRY_BYTES * n < 10 * 2**20
