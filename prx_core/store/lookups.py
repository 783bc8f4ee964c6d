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
                batch: int = LOOKUP_BATCH) -> pa.Table:
    """Rows of `uri` whose `key_column` is one of `keys` (and match `where`): a join done by the
    worker that needs it, in IN-list batches a scalar index answers (10,000 keys out of a million
    rows: 0.26 s with a BTREE index on the key), never a scan of the whole shared table per row."""
    ds = lance_io.require_table(uri, storage_options, lookup_session())
    if version is not None:
        ds = ds.checkout_version(version)
    return lookup_literals(ds, key_column, [lance_io.sql_literal(k) for k in sorted(set(keys))], columns, where,
                           batch=batch)


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


def caption_texts(storage: Storage, captioner_version: str, content_ids: Sequence[str],
                  version: int | None = None) -> dict[str, str]:
    """content_id -> caption for the given contents (successful captions of that captioner only)."""
    table = lookup_keys(storage.lance_uri("captions"), "content_id", content_ids, ["content_id", "caption"],
                        f"captioner_version = {lance_io.sql_literal(captioner_version)} AND error = ''",
                        storage.lance_storage_options(), version)
    return dict(zip(table["content_id"].to_pylist(), table["caption"].to_pylist()))


def caption_errors(storage: Storage, captioner_version: str, content_ids: Sequence[str],
                   version: int | None = None) -> dict[str, str]:
    """content_id -> stored error of the given contents' failed captions of that captioner: why
    they have none."""
    if not content_ids:
        return {}
    table = lookup_keys(storage.lance_uri("captions"), "content_id", content_ids, ["content_id", "error"],
                        f"captioner_version = {lance_io.sql_literal(captioner_version)} AND error != ''",
                        storage.lance_storage_options(), version)
    return dict(zip(table["content_id"].to_pylist(), table["error"].to_pylist()))
