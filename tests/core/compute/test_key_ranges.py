"""Content units by key range (prx_core.compute.key_ranges): every key in exactly one unit, ranges
disjoint and in order, the same plan from the same keys whichever task sampled which rows, units
of about equal rows for SHA-256 keys, and a range read finding exactly a range's rows."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import lance
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from prx_core.compute.key_ranges import SAMPLE_SCHEMA, in_range, key_samples, plan_key_ranges, range_predicate
from prx_core.compute.row_units import plan_row_units
from prx_core.store.lookups import lookup_where


def digests(n: int, salt: str = "") -> list[str]:
    return [hashlib.sha256(f"{salt}{i}".encode()).hexdigest() for i in range(n)]


def sampled(keys: list[str], chunk: int, every: int, tmp_path: Path) -> pa.Table:
    """The planning tasks' sample of `keys` written in fragments of `chunk` rows (read in process)."""
    uri = str(tmp_path / f"keys_{chunk}_{every}.lance")
    lance.write_dataset(pa.table({"content_id": keys, "source": ["s"] * len(keys)}), uri, max_rows_per_file=chunk,
                        mode="overwrite")
    version, units = plan_row_units(uri, "source = 's'", chunk)
    parts = [key_samples(uri, version, dict(u.spec), "content_id", "source = 's'", None, every) for u in units]
    return pa.concat_tables(parts) if parts else SAMPLE_SCHEMA.empty_table()


def owners(keys: list[str], units: list) -> list[int]:
    """For each key, how many units' ranges hold it."""
    array = pa.array(keys, pa.string())
    return [sum(n) for n in zip(*(in_range(array, u.spec).to_pylist() for u in units))]


@pytest.mark.parametrize(("n", "unit_rows", "chunk", "every"), [(10_000, 512, 3_000, 64), (12, 2, 5, 1), (7, 100, 4, 3)])
def test_every_key_falls_in_exactly_one_range_in_key_order(tmp_path: Path, n: int, unit_rows: int, chunk: int,
                                                           every: int) -> None:
    keys = digests(n)
    units = plan_key_ranges(sampled(keys, chunk, every, tmp_path), unit_rows)
    assert len(units) == -(-n // unit_rows) and sum(u.rows for u in units) == n
    assert [u.id for u in units] == sorted(u.id for u in units) and len({u.id for u in units}) == len(units)
    assert units[0].spec["lo"] is None and units[-1].spec["hi"] is None
    assert all(a.spec["hi"] == b.spec["lo"] for a, b in zip(units, units[1:]))  # adjacent: no gap, no overlap
    inner = [u.spec["lo"] for u in units[1:]]
    assert inner == sorted(inner)
    assert owners(keys + ["", "zz-not-a-digest", "0"], units) == [1] * (n + 3)  # any string: exactly one unit


def test_the_plan_depends_on_the_keys_not_on_how_tasks_cut_them(tmp_path: Path) -> None:
    keys = digests(5_000)
    plan = plan_key_ranges(sampled(keys, 5_000, 1, tmp_path), 500)
    shuffled = random.Random(3).sample(keys, len(keys))
    assert plan_key_ranges(sampled(shuffled, 5_000, 1, tmp_path), 500) == plan  # exact sample: exact plan
    again = sampled(keys, 1_700, 16, tmp_path)
    assert plan_key_ranges(again, 500) == plan_key_ranges(again.slice(0).sort_by("rows"), 500)  # task order: none
    sizes = [sum(owners_in(keys, u)) for u in plan_key_ranges(again, 500)]
    assert sum(sizes) == 5_000 and max(sizes) < 500 * 1.25 and min(sizes) > 500 * 0.75  # sampled: about equal


def owners_in(keys: list[str], unit) -> list[bool]:
    return in_range(pa.array(keys, pa.string()), unit.spec).to_pylist()


def test_a_range_read_finds_exactly_the_range_rows(tmp_path: Path) -> None:
    keys = digests(3_000, "x")
    uri = str(tmp_path / "t.lance")
    lance.write_dataset(pa.table({"content_id": keys, "source": ["a", "b", "c"] * 1_000}), uri)
    lance.dataset(uri).create_scalar_index("content_id", "BTREE")
    units = plan_key_ranges(sampled(keys, 3_000, 1, tmp_path), 700)
    found = []
    for unit in units:
        got = lookup_where(uri, ["content_id"], f"source = 'b' AND {range_predicate('content_id', unit.spec)}")
        assert pc.all(in_range(got["content_id"], unit.spec)).as_py() is not False
        found += got["content_id"].to_pylist()
    assert sorted(found) == sorted(keys[1::3])
    assert range_predicate("content_id", {"lo": None, "hi": None}) == "TRUE"
    assert range_predicate("content_id", {"lo": "a'b", "hi": None}) == "content_id >= 'a''b'"
