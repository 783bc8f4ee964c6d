"""Hash-partitioned aggregates on Ray workers: the questions a check asks of a whole partition
("is every sample_id unique?") answered without the driver ever holding the column.

Map tasks (one per row unit) hash the column's values and split the 64-bit hashes into `buckets`
arrays kept in the object store; one reduce task per bucket counts them. The driver holds one
object reference per (unit, bucket) and receives counts, plus a few example values read back
by a second, filtered pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from prx_core.compute.row_units import map_groups, read_row_unit, read_row_units
from prx_core.compute.units import Unit

BUCKETS = 16
EXAMPLES = 20


@dataclass(frozen=True)
class KeyCounts:
    """Rows, distinct values and the values seen more than once (a few of them, as examples)."""

    rows: int
    distinct: int
    examples: list[str] = field(default_factory=list)

    @property
    def duplicate_rows(self) -> int:
        """Rows beyond the first of their value: what would have to go for the column to be unique."""
        return self.rows - self.distinct


def hash_values(values: pa.Array) -> np.ndarray:
    """xxh64 of every (string) value as uint64."""
    import xxhash

    return np.fromiter((xxhash.xxh64_intdigest(v) for v in values.to_pylist()), np.uint64, len(values))


def count_keys(uri: str, version: int, predicate: str, column: str, units: Sequence[Unit],
               storage_options: dict[str, str] | None = None, buckets: int = BUCKETS) -> KeyCounts:
    """Exact rows and distinct values of `column` over the units' rows (up to 64-bit hash collisions,
    ~1e-4 likely at 10^8 distinct values, which would only make two values count as one)."""
    import ray

    if not units:
        return KeyCounts(0, 0)
    split = ray.remote(_split).options(num_returns=buckets)
    parts = [split.remote(uri, version, specs, predicate, column, storage_options, buckets)
             for specs in map_groups(units, buckets, 8)]  # 8-byte hashes
    if buckets == 1:
        parts = [[p] for p in parts]
    reduced = ray.get([ray.remote(_reduce).remote(*[p[b] for p in parts]) for b in range(buckets)])
    rows = sum(r[0] for r in reduced)
    distinct = sum(r[1] for r in reduced)
    wanted = np.concatenate([r[2] for r in reduced])[:EXAMPLES]
    examples: list[str] = []
    if len(wanted):
        found = ray.get([ray.remote(_pick).remote(uri, version, dict(u.spec), predicate, column, storage_options, wanted)
                         for u in units])
        examples = sorted({v for values in found for v in values})[:EXAMPLES]
    return KeyCounts(rows, distinct, examples)


def _split(uri: str, version: int, specs: list[dict], predicate: str, column: str,
           storage_options: dict[str, str] | None, buckets: int) -> tuple[np.ndarray, ...] | np.ndarray:
    hashes = hash_values(read_row_units(uri, version, specs, [column], predicate, storage_options)[column]
                         .combine_chunks())
    out = tuple(hashes[hashes % np.uint64(buckets) == b] for b in range(buckets))
    return out if buckets > 1 else out[0]


def _reduce(*parts: np.ndarray) -> tuple[int, int, np.ndarray]:
    hashes = np.concatenate(parts) if parts else np.empty(0, np.uint64)
    distinct, counts = np.unique(hashes, return_counts=True)
    return len(hashes), len(distinct), distinct[counts > 1][:EXAMPLES]


def _pick(uri: str, version: int, spec: dict, predicate: str, column: str,
          storage_options: dict[str, str] | None, wanted: np.ndarray) -> list[str]:
    values = read_row_unit(uri, version, spec, [column], predicate, storage_options)[column].combine_chunks()
    hit = np.isin(hash_values(values), wanted)
    return [v for v, h in zip(values.to_pylist(), hit) if h]
