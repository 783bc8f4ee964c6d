"""Hash-partitioned group-bys on Ray: the plumbing of a global stage that must see every row with
the same key together (all copies of one pHash across every source) on a table of any size.

Map tasks (one per group of row units, `row_units.map_groups`) read a few columns of their rows and split them by `key % buckets`
into `buckets` parts kept in the Ray object store (`num_returns=buckets`); one reduce task per
bucket concatenates its parts. The driver holds one object reference per (unit, bucket) and the
reducers' small summaries, never rows. Keys are uint64 columns, or 16-hex-digit strings read as
one (`duplicates.group_id`). Units are planned from fragment metadata and known per-fragment
counts, so planning a table of a billion rows reads no row.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from prx_core.compute.parallel import imap_tasks
from prx_core.compute.row_units import map_groups, read_row_units
from prx_core.compute.units import Unit
from prx_core.store.lance_io import StorageOptions

BUCKET_ROWS = 1_000_000  # rows per reduce task: a bucket of the six pHash columns is ~70 MB
MAX_BUCKETS = 256  # object refs grow with units x buckets: 256 keeps 1,000 units at 256k refs
_HEX = np.frombuffer(b"0123456789abcdef", np.uint8)
_NIBBLE = np.zeros(256, np.uint64)
_NIBBLE[_HEX] = np.arange(16, dtype=np.uint64)


def bucket_count(rows: int, rows_per_bucket: int = BUCKET_ROWS, max_buckets: int = MAX_BUCKETS) -> int:
    """Reduce tasks for `rows` rows: one per `rows_per_bucket`, at least 1, at most `max_buckets`."""
    return max(1, min(max_buckets, -(-rows // max(rows_per_bucket, 1))))


def fragment_units(ds: Any, rows_per_unit: int, matched: Mapping[int, int] | None = None) -> list[Unit]:
    """Row units as `row_units.plan_row_units` cuts them, from counts already known: `matched` rows
    per fragment id (default: every live row of every fragment, from the fragment metadata). A
    fragment whose live rows all match is read without a filter."""
    if rows_per_unit < 1:
        raise ValueError(f"rows_per_unit must be >= 1, got {rows_per_unit}")
    live = {f.fragment_id: f.metadata.num_rows for f in ds.get_fragments()}
    units = []
    for frag_id, rows in sorted((matched if matched is not None else live).items()):
        for offset in range(0, rows, rows_per_unit):
            spec = {"fragment": frag_id, "offset": offset, "limit": min(rows_per_unit, rows - offset),
                    "filtered": rows != live[frag_id]}
            units.append(Unit(f"f{frag_id:07d}-r{offset:010d}", spec["limit"], spec))
    return units


def hex_ids(hashes: np.ndarray) -> pa.Array:
    """uint64 values as 16 lower-case hex digits (`f"{v:016x}"`), vectorised."""
    raw = np.ascontiguousarray(hashes, dtype=">u8").view(np.uint8).reshape(-1, 8)
    digits = np.empty((len(raw), 16), np.uint8)
    digits[:, 0::2], digits[:, 1::2] = _HEX[raw >> 4], _HEX[raw & 15]
    return pa.array(digits.view("S16").ravel(), pa.binary(16)).cast(pa.string())


def parse_hex_ids(ids: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """The inverse of `hex_ids`: 16-hex-digit strings as uint64."""
    if len(ids) == 0:
        return np.empty(0, np.uint64)
    digits = np.asarray(ids.to_numpy(zero_copy_only=False).astype("S16")).view(np.uint8).reshape(-1, 16)
    if not (digits != 0).all():
        raise ValueError("group ids must be 16 hex digits")
    values = _NIBBLE[digits]
    shifts = np.arange(60, -4, -4, dtype=np.uint64)
    return np.bitwise_or.reduce(values << shifts, axis=1)


def key_values(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A key column as uint64: the values of a uint64 column, parsed hex digits of a string one."""
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        return parse_hex_ids(column)
    return np.asarray(column.to_numpy(), dtype=np.uint64)


def split(table: pa.Table, keys: np.ndarray, buckets: int) -> list[pa.Table]:
    """`table`'s rows by `keys % buckets`, one table per bucket (rows keep their order)."""
    bucket = keys % np.uint64(buckets)
    order = np.argsort(bucket, kind="stable")
    ordered = table.take(pa.array(order))
    bounds = np.concatenate([[0], np.cumsum(np.bincount(bucket.astype(np.int64), minlength=buckets))])
    return [ordered.slice(int(bounds[b]), int(bounds[b + 1] - bounds[b])) for b in range(buckets)]


def shuffle(uri: str, version: int, units: Sequence[Unit], predicate: str, columns: list[str], key: str,
            buckets: int, storage_options: StorageOptions = None, keys_only: bool = False,
            skip: Iterable[int] = ()) -> list[list[Any]]:
    """Map: one Ray task per group of units (`map_groups`: parts big enough to stay out of the
    driver's memory) splits its rows (or, `keys_only`, its distinct keys) by bucket; returns, per
    bucket, the object refs of its parts. Buckets in `skip` (reduced by an earlier
    attempt) get empty parts."""
    import ray

    task = ray.remote(_split_units).options(num_returns=buckets)
    skipped = sorted(set(skip))
    groups = map_groups(units, buckets, 8 if keys_only else 8 * len(columns))  # >= 8 bytes a value
    refs = [task.remote(uri, version, specs, predicate, columns, key, buckets, storage_options, keys_only, skipped)
            for specs in groups]
    refs = [[r] for r in refs] if buckets == 1 else refs
    return [[parts[b] for parts in refs] for b in range(buckets)]


def _split_units(uri: str, version: int, specs: list[dict], predicate: str, columns: list[str], key: str,
                 buckets: int, storage_options: StorageOptions, keys_only: bool, skip: list[int]) -> Any:
    rows = read_row_units(uri, version, specs, columns, predicate, storage_options)
    keys = key_values(rows[key])
    if keys_only:
        keys = np.unique(keys)
        parts: list[Any] = [keys[keys % np.uint64(buckets) == b] for b in range(buckets)]
    else:
        parts = split(rows, keys, buckets)
    parts = [None if b in skip else p for b, p in enumerate(parts)]
    return tuple(parts) if buckets > 1 else parts[0]


def gather(refs: Sequence[Any]) -> list[Any]:
    """In a reduce task: the bucket's parts (the map outputs are fetched here, not by the driver)."""
    import ray

    return [p for p in ray.get(list(refs)) if p is not None]


def gather_table(refs: Sequence[Any], schema: pa.Schema) -> pa.Table:
    parts = gather(refs)
    return pa.concat_tables(parts) if parts else schema.empty_table()


def gather_keys(refs: Sequence[Any]) -> np.ndarray:
    """The distinct keys of the bucket's parts, sorted."""
    parts = gather(refs)
    return np.unique(np.concatenate(parts)) if parts else np.empty(0, np.uint64)


def count_values(uri: str, version: int, fragment_ids: Sequence[int], column: str,
                 storage_options: StorageOptions = None) -> dict[int, dict[str, int]]:
    """Live rows per value of `column` in each of the fragments, one Ray task per fragment (what a
    fragment holds, for fragments not seen before: work grows with them, not with the table)."""
    if not fragment_ids:
        return {}
    calls = ((uri, version, f, column, storage_options) for f in fragment_ids)
    return {fragment_ids[n]: counts for n, counts in imap_tasks(_count_fragment, calls)}


def _count_fragment(uri: str, version: int, fragment_id: int, column: str,
                    storage_options: StorageOptions) -> dict[str, int]:
    import lance
    import pyarrow.compute as pc

    ds = lance.dataset(uri, version=version, storage_options=storage_options or None)
    values = ds.get_fragment(fragment_id).to_table(columns=[column])[column]
    counts = pc.value_counts(values)
    return {str(v): int(n) for v, n in zip(counts.field("values").to_pylist(), counts.field("counts").to_pylist())}
