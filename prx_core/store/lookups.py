"""Joins done by the worker that needs them: rows of a table by a batch of keys, through the
key's BTREE index (prx_core.store.schemas.BTREE_COLUMNS)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import lance
import pyarrow as pa

from prx_core.store import lance_io
from prx_core.store.storage import Storage

LOOKUP_BATCH = 5_000
# What one process keeps of the index pages and manifests its lookups read (an LRU: past it a
# lookup reads pages again, as it would without the cache). ~76 MB holds a 1M-row content_id BTREE.
LOOKUP_INDEX_CACHE_BYTES = 512 << 20
LOOKUP_METADATA_CACHE_BYTES = 64 << 20


@functools.cache
def lookup_session() -> lance.Session:
    """The process's one cache for lookups. A worker runs many units against the same shared
    tables; opening each table afresh per unit re-read every BTREE page a batch of random keys
    touches (5,000 sha256 keys in a 1M-row table: 0.2 s per lookup cold, 0.03 s warm), so a
    unit's lookups grew with the table instead of with the unit."""
    return lance.Session(index_cache_size_bytes=LOOKUP_INDEX_CACHE_BYTES,
                         metadata_cache_size_bytes=LOOKUP_METADATA_CACHE_BYTES)


def lookup_keys(uri: str, key_column: str, keys: Sequence[str], columns: list[str], where: str | None = None,
                storage_options: dict[str, str] | None = None, version: int | None = None,
                batch: int = LOOKUP_BATCH, with_row_address: bool = False) -> pa.Table:
    """Rows of `uri` whose `key_column` is one of `keys` (and match `where`): a join done by the
    worker that needs it, in IN-list batches a scalar index answers (10,000 keys out of a million
    rows: 0.26 s with a BTREE index on the key), never a scan of the whole shared table per row."""
    ds = lance_io.require_table(uri, storage_options, lookup_session())
    if version is not None:
        ds = ds.checkout_version(version)
    return lookup_literals(ds, key_column, [lance_io.sql_literal(k) for k in sorted(set(keys))], columns, where,
                           with_row_address=with_row_address, batch=batch)


def lookup_where(uri: str, columns: list[str], where: str, storage_options: dict[str, str] | None = None,
                 version: int | None = None, with_row_address: bool = False) -> pa.Table:
    """Rows of `uri` matching `where`, opened through the process's lookup cache: for a key range
    (`lo <= key < hi`, prx_core.compute.key_ranges), which a BTREE answers from the few pages the
    range covers, however many rows the table holds."""
    ds = lance_io.require_table(uri, storage_options, lookup_session())
    if version is not None:
        ds = ds.checkout_version(version)
    return ds.to_table(columns=columns, filter=where, with_row_address=with_row_address)


def lookup_literals(ds: Any, column: str, literals: Sequence[str], columns: list[str], where: str | None = None,
                    with_row_address: bool = False, batch: int = LOOKUP_BATCH) -> pa.Table:
    """Rows of the dataset whose `column` is one of the SQL `literals` (quoted strings, numbers)
    and match `where`, in IN-list batches a BTREE index answers; with their row addresses if asked."""
    extra = f" AND ({where})" if where else ""
    parts = [ds.to_table(columns=columns, filter=f"{column} IN ({', '.join(literals[i:i + batch])}){extra}",
                         with_row_address=with_row_address) for i in range(0, len(literals), batch)]
    if parts:
        return pa.concat_tables(parts)
    fields = [ds.schema.field(c) for c in columns] + ([pa.field("_rowaddr", pa.uint64())] if with_row_address else [])
    return pa.schema(fields).empty_table()


def table_columns(storage: Storage, table: str, version: int | None = None) -> set[str]:
    """The columns `table` has at `version` (none when it does not exist): a reader of a table
    written before a column was appended asks before it reads it."""
    try:
        ds = lance_io.require_table(storage.lance_uri(table), storage.lance_storage_options(), lookup_session())
    except lance_io.TableNotFoundError:
        return set()
    return set((ds.checkout_version(version) if version is not None else ds).schema.names)


def has_verdicts(storage: Storage, version: int | None = None) -> bool:
    """Whether `captions` (at `version`) has the quality columns: a table written before the
    caption checks existed gains them at the next captions run, and holds no rejected caption."""
    return "verdict" in table_columns(storage, "captions", version)


def shipped_filter(storage: Storage, captioner_version: str, version: int | None = None) -> str:
    """The filter of a captioner version's captions that may be trained on: captioned, and not
    rejected by the caption checks (prx_core.models.caption_checks)."""
    where = f"captioner_version = {lance_io.sql_literal(captioner_version)} AND error = ''"
    return where + (" AND (verdict IS NULL OR verdict != 'rejected')" if has_verdicts(storage, version) else "")


def shipped_captions(storage: Storage, captioner_version: str, keys: Sequence[str],
                     version: int | None = None) -> pa.Table:
    """(content_id, caption) of the given keys (content ids, or a `source` captioner's keys:
    prx_core.models.caption_keys) that have a shipped caption of that captioner."""
    if not keys:
        return pa.table({"content_id": pa.array([], pa.string()), "caption": pa.array([], pa.string())})
    return lookup_keys(storage.lance_uri("captions"), "content_id", keys, ["content_id", "caption"],
                       shipped_filter(storage, captioner_version, version), storage.lance_storage_options(), version)


def caption_gaps(storage: Storage, captioner_version: str, keys: Sequence[str],
                 version: int | None = None) -> dict[str, tuple[str, str]]:
    """caption key -> (stored error, problem) of the given keys' captions that cannot be shipped:
    a failure (its error; retried on the next run), or a caption the checks rejected ("", its problem)."""
    if not keys:
        return {}
    checked = has_verdicts(storage, version)
    rejected = " OR verdict = 'rejected'" if checked else ""
    table = lookup_keys(storage.lance_uri("captions"), "content_id", keys,
                        ["content_id", "error"] + (["problem"] if checked else []),
                        f"captioner_version = {lance_io.sql_literal(captioner_version)} AND (error != ''{rejected})",
                        storage.lance_storage_options(), version)
    problems = table["problem"].to_pylist() if checked else [None] * table.num_rows
    return {k: (e or "", "" if e else p or "") for k, e, p in
            zip(table["content_id"].to_pylist(), table["error"].to_pylist(), problems)}
