"""Work units that own a range of a hash key (content ids: SHA-256 hex) instead of a row range.

A unit of a row range holds random content ids, so its lookups in a table keyed by content
(a BTREE's pages hold ~4,096 keys) touch nearly every page of the index: its bytes read grow with
the table. A unit that owns `lo <= key < hi` looks up keys that sit together in the index, a few
pages whatever the table's size (docs/scale.md, `benchmarks.content_ranges`).

The ranges are cut from the partition's keys, sorted on workers: each planning task sorts one
row range's keys and returns every `every`-th, each standing for the `every` rows after it
(`key_samples`); the driver orders that sample (1/`every` of the keys) and cuts it into ranges of
equal rows (`plan_key_ranges`). The same rows give the same sample, so the same plan (unit ids
are range numbers). The first range has no lower bound and the last no upper one, so every key
falls in exactly one unit; a range's rows are its share of the sample, each task off by less than
`every` at each bound (SHA-256 keys are uniform, so equal ranges are equal units).

A range of one partition's keys also holds every other partition's keys between them: in a table
of T rows, a partition of P rows has ~T/P of the table's rows per row of its own in any range, and
the unit's range reads and key lookups cross all of them (the BTREE pages of its range). So a unit
of a small partition in a big table would read more the bigger the table grows (measured through
the stages: `benchmarks.corpus_growth`, docs/benchmarks.md). `range_unit_rows` cuts such a
partition into smaller units, each spanning at most RANGE_TABLE_ROWS rows of the table (or its own
rows, for bigger units) whatever the table's size: a unit's cost is bounded, and the run's is the
span of the partition's keys, as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from prx_core.compute.parallel import imap_tasks, on_cluster
from prx_core.compute.row_units import plan_row_units, read_row_unit
from prx_core.compute.units import Unit
from prx_core.store import lance_io
from prx_core.store.lance_io import StorageOptions, sql_literal

SAMPLE_SCHEMA = pa.schema([("key", pa.string()), ("rows", pa.int64())])
PLAN_ROWS = 1_000_000  # keys a planning task sorts (a fragment's worth: 64 MB of content ids)
SAMPLES_PER_UNIT = 8  # keys per unit's worth of rows the planning tasks return (512 per 4,096-row unit)
# rows of the whole table (every partition's) one unit's range may span: a range read and a lookup
# of its keys read at most ~64 BTREE pages of each table they touch (~19 MB of a content_id index)
RANGE_TABLE_ROWS = 1 << 18


def plan_partition_ranges(uri: str, column: str, predicate: str, unit_rows: int,
                          storage_options: StorageOptions = None) -> tuple[int, list[Unit]]:
    """(the version read, units) of the rows of `uri` matching `predicate` (a source's partition):
    ranges of `column` of `unit_rows` rows each, or fewer where the partition is a small part of
    the table (`range_unit_rows`), cut from a sample of its keys that Ray tasks sort, one per
    PLAN_ROWS rows (in this process off Ray). Units of the smaller size have ids of their own
    (`k<rows>r<n>`), so a resumed attempt whose table grew past the next size never takes a recorded
    unit of the other size for one of its own ranges."""
    version, chunks = plan_row_units(uri, predicate, PLAN_ROWS, storage_options)
    table_rows = lance_io.require_table(uri, storage_options).checkout_version(version).count_rows()
    rows = range_unit_rows(unit_rows, sum(c.rows for c in chunks), table_rows)
    calls = [(uri, version, dict(c.spec), column, predicate, storage_options, max(1, rows // SAMPLES_PER_UNIT))
             for c in chunks]
    parts = ([part for _, part in imap_tasks(key_samples, calls)] if on_cluster()
             else [key_samples(*call) for call in calls])
    sample = pa.concat_tables(parts) if parts else SAMPLE_SCHEMA.empty_table()
    return version, plan_key_ranges(sample, rows, prefix="k" if rows == unit_rows else f"k{rows}r")


def range_unit_rows(unit_rows: int, partition_rows: int, table_rows: int) -> int:
    """Rows per unit of a partition of `partition_rows` in a table of `table_rows`: `unit_rows`
    while such a unit's range spans at most RANGE_TABLE_ROWS rows of the table (or `unit_rows`,
    for units sized bigger than that: `mds_shards`' route units), else the largest power of two
    that does (a table that grows a little does not change the plan), at least 1."""
    budget = max(unit_rows, RANGE_TABLE_ROWS)
    if partition_rows <= 0 or unit_rows * table_rows <= budget * partition_rows:
        return unit_rows
    fit = budget * partition_rows // table_rows
    return min(unit_rows, 1 << (fit.bit_length() - 1)) if fit >= 1 else 1


def key_samples(uri: str, version: int, spec: dict, column: str, predicate: str, storage_options: StorageOptions,
                every: int) -> pa.Table:
    """On a worker: one row unit's `column` sorted, every `every`-th value from the first, each
    with the rows it stands for (itself and the next `every - 1`; the last, the rest)."""
    keys = read_row_unit(uri, version, spec, [column], predicate, storage_options)[column].combine_chunks()
    ordered = keys.filter(pc.is_valid(keys)).cast(pa.string())
    ordered = ordered.take(pc.sort_indices(ordered))
    picks = list(range(0, len(ordered), every))
    rows = [min(every, len(ordered) - i) for i in picks]
    return pa.table({"key": ordered.take(pa.array(picks, pa.int64())), "rows": pa.array(rows, pa.int64())},
                    schema=SAMPLE_SCHEMA)


def plan_key_ranges(sample: pa.Table, rows_per_unit: int, prefix: str = "k") -> list[Unit]:
    """Units of `ceil(rows / rows_per_unit)` ranges of equal rows of a `key_samples` sample (every
    task's, in any order), ids `<prefix><n>` in key order, spec `{"lo": ..., "hi": ...}` (None: unbounded)."""
    if rows_per_unit < 1:
        raise ValueError(f"rows_per_unit must be >= 1, got {rows_per_unit}")
    ordered = sample.sort_by([("key", "ascending"), ("rows", "ascending")])
    keys, counts = ordered["key"].to_pylist(), ordered["rows"].to_pylist()
    total = sum(counts)
    count = -(-total // rows_per_unit)
    bounds: list[str | None] = [None]
    before = 0  # rows of the sample keys before position j
    j = 0
    for i in range(1, count):
        while j < len(keys) and before + counts[j] <= total * i // count:
            before += counts[j]
            j += 1
        bounds.append(keys[j] if j < len(keys) else keys[-1])
    bounds.append(None)
    shares = [total * (i + 1) // count - total * i // count for i in range(count)]
    return [Unit(f"{prefix}{i:07d}", shares[i], {"lo": bounds[i], "hi": bounds[i + 1]}) for i in range(count)]


def range_predicate(column: str, spec: Mapping[str, Any]) -> str:
    """SQL for a unit's range of `column` (`TRUE` for a single unbounded unit): a BTREE answers it
    from the few pages the range covers."""
    parts = ([f"{column} >= {sql_literal(spec['lo'])}"] if spec.get("lo") is not None else []) + (
        [f"{column} < {sql_literal(spec['hi'])}"] if spec.get("hi") is not None else [])
    return " AND ".join(parts) or "TRUE"


def in_range(keys: pa.Array | pa.ChunkedArray, spec: Mapping[str, Any]) -> pa.Array | pa.ChunkedArray:
    """Which of `keys` fall in the unit's range (the same rule as `range_predicate`)."""
    mask = pc.is_valid(keys)
    if spec.get("lo") is not None:
        mask = pc.and_(mask, pc.greater_equal(keys, spec["lo"]))
    if spec.get("hi") is not None:
        mask = pc.and_(mask, pc.less(keys, spec["hi"]))
    return mask
