"""Per-source partitions of the corpus tables: their predicates, their one-commit replacement,
and the `rejects` row every stage writes for a sample it refuses."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa
from lance.fragment import FragmentMetadata

from prx_core.store.names import validate_source_name
from prx_core.store import lance_io, maintenance, schemas
from prx_core.store.storage import Storage


def source_predicate(source: str) -> str:
    """The filter of one source's rows; every per-source read, replace and delete builds it here,
    so a source name that is not a catalog name (`..`, `a/b`, ``) is refused before any I/O."""
    return f"source = {lance_io.sql_literal(validate_source_name(source))}"


def rejects_predicate(source: str, stage: str) -> str:
    return f"{source_predicate(source)} AND stage = {lance_io.sql_literal(stage)}"


# Builds a committed table's delta indexes: (uri, table, storage options) -> report. In the
# process by default; the stages pass `prx_core.upkeep.indexing.index_table`, a Ray task.
Indexer = Callable[[str, str, lance_io.StorageOptions], maintenance.IndexReport]


def write_partition(storage: Storage, table: str, predicate: str, rows: pa.Table,
                    index: Indexer = maintenance.refresh_table_indexes) -> int:
    """Replace one partition of a per-source table with rows held by the caller (small tables)."""
    fragments = lance_io.write_fragments(storage.lance_uri(table), rows, schemas.TABLES[table],
                                         storage.lance_storage_options())
    return commit_partition(storage, table, predicate, fragments, index)


def commit_partition(storage: Storage, table: str, predicate: str, fragments: Sequence[FragmentMetadata],
                     index: Indexer = maintenance.refresh_table_indexes) -> int:
    """Replace one partition of a per-source table by fragments written elsewhere (by workers), in
    one commit, and index the new fragments with `index` (a delta segment: merging the whole
    index is compact_corpus's job); returns the version readers see."""
    uri, options = storage.lance_uri(table), storage.lance_storage_options()
    lance_io.replace_rows(uri, predicate, fragments, schemas.TABLES[table], options)
    return index(uri, table, options).version


def write_rejects(storage: Storage, rows: pa.Table) -> list[FragmentMetadata]:
    """A worker's reject rows as uncommitted `rejects` fragments (none for no rows)."""
    if rows.num_rows == 0:
        return []
    return lance_io.write_fragments(storage.lance_uri("rejects"), rows, schemas.REJECTS,
                                    storage.lance_storage_options())


def reject_row(
    sid: str, source: str, key: str, cid: str | None, stage: str, reason: str, message: str,
    width: int | None = None, height: int | None = None,
) -> dict[str, Any]:
    return {
        "sample_id": sid, "source": source, "source_key": key, "content_id": cid, "stage": stage,
        "reason": reason, "message": message, "width": width, "height": height,
    }


def reject_examples(storage: Storage, source: str, stage: str, limit: int = 50) -> list[dict[str, Any]]:
    """The first `limit` rejects of a partition and stage (key, reason, message) for metadata."""
    ds = lance_io.open_table(storage.lance_uri("rejects"), storage.lance_storage_options())
    if ds is None:
        return []
    return ds.to_table(columns=["source_key", "reason", "message"], filter=rejects_predicate(source, stage),
                       limit=limit).to_pylist()


def unit_outputs(storage: Storage, table: str, written: Sequence[FragmentMetadata],
                 refused: Sequence[FragmentMetadata]) -> dict[str, Any]:
    """What a work unit reports about the uncommitted fragments it wrote to `table` and to
    `rejects`: their metadata for the commit, and their files for the cleanup of an abandoned run."""
    return {"fragments": [f.to_json() for f in written], "rejects_fragments": [f.to_json() for f in refused],
            "outputs": lance_io.fragment_files(storage.lance_uri(table), written)
            + lance_io.fragment_files(storage.lance_uri("rejects"), refused)}


def commit_unit_outputs(storage: Storage, table: str, source: str, stage: str, summaries: Sequence[dict[str, Any]],
                        index: Indexer = maintenance.refresh_table_indexes) -> tuple[int, int]:
    """Replace the partition of `table` and the stage's rejects of `source` by what the units
    wrote (`unit_outputs`), one commit each; returns both versions readers see."""
    fragments = lance_io.fragments_from_json(f for s in summaries for f in s["fragments"])
    refused = lance_io.fragments_from_json(f for s in summaries for f in s["rejects_fragments"])
    return (commit_partition(storage, table, source_predicate(source), fragments, index),
            commit_partition(storage, "rejects", rejects_predicate(source, stage), refused, index))
