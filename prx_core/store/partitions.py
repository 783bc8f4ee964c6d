"""Per-source partitions of the corpus tables: their predicates, their one-commit replacement,
and the `rejects` row every stage writes for a sample it refuses."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from prx_core.store import lance_io, maintenance, schemas
from prx_core.store.storage import Storage


def source_predicate(source: str) -> str:
    return f"source = {lance_io.sql_literal(source)}"


def rejects_predicate(source: str, stage: str) -> str:
    return f"{source_predicate(source)} AND stage = {lance_io.sql_literal(stage)}"


def write_partition(storage: Storage, table: str, predicate: str, rows: pa.Table) -> int:
    """Replace one partition of a per-source table in one commit and catch its indexes up;
    returns the version readers see."""
    uri, options = storage.lance_uri(table), storage.lance_storage_options()
    lance_io.replace_partition(uri, predicate, rows, schemas.TABLES[table], options)
    return maintenance.refresh_table_indexes(uri, table, options).version


def reject_row(
    sid: str, source: str, key: str, cid: str | None, stage: str, reason: str, message: str,
    width: int | None = None, height: int | None = None,
) -> dict[str, Any]:
    return {
        "sample_id": sid, "source": source, "source_key": key, "content_id": cid, "stage": stage,
        "reason": reason, "message": message, "width": width, "height": height,
    }
