"""Issue 24, hazard 6: a shuffle's map outputs stay out of the driver's memory. Ray keeps a task's
return under its inline limit (100 KiB) in the owner's, the driver's, memory: map tasks are sized
(`row_units.map_groups`) so every part is over it. Simulated with a Ray whose inline limit is
1 KiB and parts sized for 2 KiB: per-unit map tasks would make 200-byte parts, all inline."""

from __future__ import annotations

import time
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa
import pytest

from prx_core.compute import row_units
from prx_core.compute.quiet import start_ray
from prx_core.compute.groupby import gather_keys, gather_table, shuffle
from prx_core.compute.row_units import map_groups, plan_row_units
from prx_core.compute.shuffle import count_keys
from prx_core.compute.units import Unit

ROWS, PER_FRAGMENT, BUCKETS = 2400, 100, 4


@pytest.fixture(scope="module")
def small_inline_ray():
    import ray

    if ray.is_initialized():  # another module's cluster has Ray's default inline limit
        ray.shutdown()
    start_ray(num_cpus=1, log_to_driver=False, _system_config={"max_direct_call_object_size": 1024})
    yield ray
    ray.shutdown()


@pytest.fixture()
def table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, pa.Table]:
    monkeypatch.setattr(row_units, "PART_BYTES", 2048)
    rng = np.random.default_rng(3)
    rows = pa.table({"phash": pa.array(rng.integers(0, 2**63, ROWS, dtype=np.uint64) % 1500, pa.uint64()),
                     "sample_id": [f"s/{i:06d}" for i in range(ROWS)]})
    uri = str(tmp_path / "t.lance")
    lance.write_dataset(rows, uri, max_rows_per_file=PER_FRAGMENT)
    return uri, rows


def in_the_object_store(ray, parts: list[list], patience_s: float = 60.0) -> list[bool]:
    """Per part, whether it has a node location (an inline return never gets one). A store object's
    location reaches its owner asynchronously: on a loaded machine it can lag the task's end, so
    this asks again until every part has one or the patience runs out."""
    refs = [r for bucket in parts for r in bucket]
    ray.wait(refs, num_returns=len(refs))
    deadline = time.monotonic() + patience_s
    while True:
        found = [bool(loc["node_ids"]) for loc in ray.experimental.get_object_locations(refs).values()]
        if all(found) or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def test_no_part_is_kept_in_the_driver_and_every_row_arrives(small_inline_ray, table) -> None:
    uri, rows = table
    version, units = plan_row_units(uri, "true", PER_FRAGMENT)
    assert len(units) == ROWS // PER_FRAGMENT
    keys = shuffle(uri, version, units, "true", ["phash"], "phash", BUCKETS, keys_only=True)
    full = shuffle(uri, version, units, "true", ["phash", "sample_id"], "phash", BUCKETS)
    assert all(in_the_object_store(small_inline_ray, keys)) and all(in_the_object_store(small_inline_ray, full))
    assert len(keys[0]) < len(units) and len(full[0]) < len(units)  # units grouped into fewer map tasks

    ray = small_inline_ray
    got_keys = np.concatenate(ray.get([ray.remote(gather_keys).remote(bucket) for bucket in keys]))
    assert sorted(got_keys.tolist()) == sorted(set(rows["phash"].to_pylist()))
    got = pa.concat_tables(ray.get([ray.remote(gather_table).remote(b, rows.schema) for b in full]))
    assert sorted(got["sample_id"].to_pylist()) == rows["sample_id"].to_pylist()
    for b, bucket in enumerate(ray.get([ray.remote(gather_table).remote(p, rows.schema) for p in full])):
        assert all(h % BUCKETS == b for h in bucket["phash"].to_pylist())
    counted = count_keys(uri, version, "true", "sample_id", units)
    assert (counted.rows, counted.distinct) == (ROWS, ROWS)


@pytest.mark.parametrize("rows,want_groups", [([100] * 24, [11, 13]), ([100] * 5, [5]), ([5000, 10, 10], [3]),
                                              ([], [])])
def test_map_groups_close_at_the_rows_a_part_needs(rows: list[int], want_groups: list[int]) -> None:
    units = [Unit(f"u{i}", n, {"n": i}) for i, n in enumerate(rows)]
    groups = map_groups(units, BUCKETS, 8, part_bytes=2048)  # 1,024 rows a group
    assert [len(g) for g in groups] == want_groups
    assert [s["n"] for g in groups for s in g] == list(range(len(rows)))  # every unit once, in order
