"""Content units by key range (prx_core.compute.key_ranges): every key in exactly one unit, ranges
disjoint and in order, the same plan from the same keys whichever task sampled which rows, units
of about equal rows for SHA-256 keys, and a range read finding exactly a range's rows."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from unittest.mock import patch

import lance
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from prx_core.compute import key_ranges
from prx_core.compute.key_ranges import (RANGE_TABLE_ROWS, SAMPLE_SCHEMA, in_range, key_samples, plan_key_ranges,
                                         range_predicate, range_unit_rows)
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


@pytest.mark.parametrize(("unit_rows", "partition", "table", "expected"), [
    (4_096, 100_000, 100_000, 4_096),  # the whole table: as configured
    (4_096, 100_000, 1_000_000, 4_096),  # a tenth of it: 40,960 rows spanned, under the budget
    (4_096, 20_000, 16_000_000, 256),  # 1/800: 2**18 * 20,000 / 16M = 327 rows fit, so 256
    (4_096, 20_000, 17_000_000, 256),  # a table a little bigger: the same plan
    (4_096, 10, 1_000_000_000, 1),  # never below one row
    (1_000_000, 1_000_000, 1_000_000, 1_000_000),  # bigger units (mds route) span their own rows
    (1_000_000, 1_000_000, 4_000_000, 131_072),  # ... or their own size of the table (250,000 fit)
    (4_096, 0, 1_000, 4_096),  # an empty partition plans nothing either way
])
def test_a_small_partition_in_a_big_table_gets_units_of_a_bounded_span(unit_rows: int, partition: int, table: int,
                                                                       expected: int) -> None:
    rows = range_unit_rows(unit_rows, partition, table)
    assert rows == expected
    if partition and rows < unit_rows:  # the span is within budget, and twice the rows would not be
        budget = max(unit_rows, RANGE_TABLE_ROWS)
        assert rows * table <= budget * partition < 2 * rows * table or rows == 1


def test_a_range_plan_spans_a_bounded_part_of_the_table_and_ids_say_its_size(tmp_path: Path) -> None:
    """One source of 2,000 keys among 60,000 of others: units of 4,096 rows would each span the
    whole table; with a budget of 8,192 table rows a unit holds 256 of the source's rows (2,000 *
    8,192 / 62,000 = 264 fit), and its range holds about 8,000 rows of all sources."""
    mine, others = digests(2_000, "mine"), digests(60_000, "others")
    uri = str(tmp_path / "t.lance")
    lance.write_dataset(pa.table({"content_id": mine + others, "source": ["s"] * 2_000 + ["o"] * 60_000}), uri)
    with patch("prx_core.compute.key_ranges.RANGE_TABLE_ROWS", 8_192):
        _, units = key_ranges.plan_partition_ranges(uri, "content_id", "source = 's'", 4_096)
    assert len(units) == 8 and all(u.id.startswith("k256r") for u in units)  # ceil(2,000 / 256)
    assert set(owners(mine, units)) == {1}  # every key of the source in exactly one unit
    spans = [sum(owners_in(mine + others, u)) for u in units]
    assert sum(spans) == 62_000 and max(spans) < 8_192 * 1.3, spans
    _, whole = key_ranges.plan_partition_ranges(uri, "content_id", "source = 'o'", 4_096)  # most of the table
    assert [u.id for u in whole] == [f"k{i:07d}" for i in range(15)]  # ceil(60,000 / 4,096): as configured
