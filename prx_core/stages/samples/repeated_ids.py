"""`sample_id`s repeated across a source's files, found and resolved after `samples` commits.

Readers refuse a key repeated inside one fragment (`duplicate_key`), and keys built from paths are
unique by construction; a key repeated across fragments (a parquet key column that repeats
between files) only shows over the whole partition. One such row must not halt the source, nor
reach MDS, skip-lists and the explorer under an ambiguous id: while the repeated rows are few
(at most `limit`, the check's threshold times the rows), one row per sample_id is kept (the
smallest content_id, then the first row) and the others move to `rejects` (reason
`duplicate_key`, stage `samples`, so the next run of `samples` replaces them), one commit each.
More than `limit` is a catalog problem (a wrong key column): nothing is changed and the
blocking check fails. The search is the hash shuffle of prx_core.compute.shuffle on workers; the
driver holds only the repeated rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from prx_core.compute.row_units import map_groups, plan_row_units, read_row_unit, read_row_units
from prx_core.compute.shuffle import BUCKETS, hash_values
from prx_core.store import lance_io, schemas
from prx_core.store.partitions import reject_row, source_predicate, write_rejects
from prx_core.store.storage import Storage

DUPLICATE_KEY = "duplicate_key"  # the readers' reason for a key repeated inside one fragment
COLUMNS = ["sample_id", "content_id", "source_key"]
DELETE_BATCH = 2_000  # row addresses per delete predicate


class IngestCounts(Protocol):
    """What settlement reads and brings up to date of an ingest's report (`SamplesReport`; a
    protocol, so that the stage declaring this step can import it without a circle)."""

    source: str
    rows: int
    rejected: int
    reasons: dict[str, int]
    samples_version: int
    rejects_version: int


@dataclass(frozen=True)
class KeyResolution:
    """Rows of the partition, rows beyond the first of their sample_id, whether they were moved
    to `rejects`, and the rows a reader of the table sees (versions after the moves)."""

    rows: int
    duplicate_rows: int
    resolved: bool
    offenders: list[dict[str, Any]] = field(default_factory=list)  # sample_id, content_id, reason
    samples_version: int | None = None
    rejects_version: int | None = None


def resolve_duplicate_ids(storage: Storage, source: str, version: int, limit: int,
                          unit_rows: int = 1_000_000, examples: int = 100) -> KeyResolution:
    """Find the partition's repeated sample_ids (at `version`) and, when at most `limit` rows are
    in excess, keep one row of each and move the others to `rejects`. It writes the samples
    partition: the caller holds its lock (the samples stage's follow-up step runs under it)."""
    import ray

    uri, options = storage.lance_uri("samples"), storage.lance_storage_options()
    predicate = source_predicate(source)
    _, units = plan_row_units(uri, predicate, unit_rows, options, version=version)
    if not units:
        return KeyResolution(0, 0, True, samples_version=version)
    split = ray.remote(_split).options(num_returns=BUCKETS)
    parts = [split.remote(uri, version, specs, predicate, options) for specs in map_groups(units, BUCKETS, 8)]
    reduced = ray.get([ray.remote(_reduce).remote(limit + 1, *[p[b] for p in parts]) for b in range(BUCKETS)])
    rows, excess = sum(r[0] for r in reduced), sum(r[1] for r in reduced)
    wanted = np.concatenate([r[2] for r in reduced])
    if excess == 0:
        return KeyResolution(rows, 0, True, samples_version=version)
    picked = ray.get([ray.remote(_pick).remote(uri, version, dict(u.spec), predicate, options, wanted) for u in units])
    repeated = pa.concat_tables(picked).to_pylist()
    losers = losing_rows(repeated)
    offenders = [{"sample_id": r["sample_id"], "content_id": r["content_id"], "reason": DUPLICATE_KEY}
                 for r in sorted(losers, key=lambda r: (r["sample_id"], r["content_id"] or ""))[:examples]]
    if excess > limit:
        return KeyResolution(rows, excess, False, offenders, samples_version=version)
    rejects = pa.Table.from_pylist([reject_row(r["sample_id"], source, r["source_key"], r["content_id"], "samples",
                                               DUPLICATE_KEY, "sample_id repeated in another source file: "
                                               "the row with the smallest content_id is kept")
                                    for r in losers], schema=schemas.REJECTS)
    rejects_version = lance_io.replace_rows(storage.lance_uri("rejects"), "", write_rejects(storage, rejects),
                                            schemas.REJECTS, options)
    ds = lance_io.require_table(uri, options)
    addresses = [r["_rowaddr"] for r in losers]
    for start in range(0, len(addresses), DELETE_BATCH):
        ds.delete(f"_rowaddr IN ({', '.join(str(a) for a in addresses[start:start + DELETE_BATCH])})")
    return KeyResolution(rows, excess, True, offenders, lance_io.table_version(uri, options), rejects_version)


def losing_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """All rows of each repeated sample_id but the kept one (smallest content_id, then row address)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(row["sample_id"], []).append(row)
    out = []
    for group in groups.values():
        ordered = sorted(group, key=lambda r: (r["content_id"] or "", r["_rowaddr"]))
        out += ordered[1:]
    return out


def _split(uri: str, version: int, specs: list[dict], predicate: str,
           storage_options: dict[str, str] | None) -> tuple[np.ndarray, ...]:
    hashes = hash_values(read_row_units(uri, version, specs, ["sample_id"], predicate, storage_options)["sample_id"]
                         .combine_chunks())
    return tuple(hashes[hashes % np.uint64(BUCKETS) == b] for b in range(BUCKETS))


def _reduce(cap: int, *parts: np.ndarray) -> tuple[int, int, np.ndarray]:
    """(rows, rows beyond the first of their hash, up to `cap` repeated hashes)."""
    hashes = np.concatenate(parts) if parts else np.empty(0, np.uint64)
    distinct, counts = np.unique(hashes, return_counts=True)
    return len(hashes), len(hashes) - len(distinct), distinct[counts > 1][:cap]


def _pick(uri: str, version: int, spec: dict, predicate: str, storage_options: dict[str, str] | None,
          wanted: np.ndarray) -> pa.Table:
    rows = read_row_unit(uri, version, spec, COLUMNS, predicate, storage_options, with_row_address=True)
    hit = np.isin(hash_values(rows["sample_id"].combine_chunks()), wanted)
    return rows.filter(pa.array(hit))


def settle_sample_ids(storage: Storage, report: IngestCounts, max_rate: float) -> KeyResolution:
    """`resolve_duplicate_ids` after `build_samples`, with `report` brought up to date (rows,
    rejects, reasons, the versions downstream stages read) when rows moved to `rejects`."""
    keys = resolve_duplicate_ids(storage, report.source, report.samples_version, int(max_rate * report.rows))
    if keys.resolved and keys.duplicate_rows:
        report.rows -= keys.duplicate_rows
        report.rejected += keys.duplicate_rows
        report.reasons = {**report.reasons, DUPLICATE_KEY: report.reasons.get(DUPLICATE_KEY, 0) + keys.duplicate_rows}
        report.samples_version = keys.samples_version
        report.rejects_version = keys.rejects_version
    return keys
