"""Lance table I/O for the corpus: one-commit partition replacement, upserts, reads.

Heavy tables are written as uncommitted fragments (in parallel, e.g. in Ray tasks) and then
published by the driver in ONE commit that also removes the partition's previous rows, so a
rerun is idempotent and a crash before the commit leaves the previous version intact. Works on
local paths and `s3://` URIs; `storage_options` are pylance's (`storage.lance_storage_options`).
Pure library: never imports dagster.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from collections.abc import Iterable, Sequence

import lance
import numpy as np
import pyarrow as pa
from lance import LanceDataset, LanceOperation
from lance.commit import CommitConflictError
from lance.fragment import FragmentMetadata

from prx_core.store import fencing
from prx_core.store.storage import naming_full_disk

log = logging.getLogger(__name__)

StorageOptions = dict[str, str] | None
BATCH_BYTES = 8 << 20
PRIMARY_KEY = {b"lance-schema:unenforced-primary-key": b"true"}


class TableNotFoundError(FileNotFoundError):
    """A Lance table that must exist does not (the message names its URI)."""


class _CreationRaced(Exception):
    """Another writer created the table between our existence check and our create commit."""


def sql_literal(value: str) -> str:
    """A single-quoted SQL string literal for Lance filters (quotes doubled, NUL refused)."""
    if "\x00" in value:
        raise ValueError("NUL character in a SQL literal")
    return "'" + value.replace("'", "''") + "'"


def open_table(uri: str, storage_options: StorageOptions = None,
               session: lance.Session | None = None) -> LanceDataset | None:
    """The latest version of the table, or None when it does not exist yet; `session` is a cache
    of index pages and manifests shared with other opens."""
    try:
        return lance.dataset(uri, storage_options=storage_options or None, session=session)
    except (ValueError, OSError) as exc:
        if "not found" in str(exc).lower():
            return None
        raise


def table_exists(uri: str, storage_options: StorageOptions = None) -> bool:
    return open_table(uri, storage_options) is not None


def table_version(uri: str, storage_options: StorageOptions = None) -> int | None:
    return None if (ds := open_table(uri, storage_options)) is None else ds.version


def require_table(uri: str, storage_options: StorageOptions = None,
                  session: lance.Session | None = None) -> LanceDataset:
    """Like `open_table`, but a missing table is an error naming it."""
    ds = open_table(uri, storage_options, session)
    if ds is None:
        raise TableNotFoundError(f"Lance table {uri} does not exist (has its asset been materialized?)")
    return ds


def read_table(uri: str, columns: list[str] | None = None, filter: str | None = None,
               storage_options: StorageOptions = None, version: int | None = None) -> pa.Table:
    """Read (a projection of) the table; a missing table raises `TableNotFoundError`."""
    ds = require_table(uri, storage_options)
    if version is not None:
        ds = ds.checkout_version(version)
    return ds.to_table(columns=columns, filter=filter)


def write_fragments(uri: str, data: pa.Table | pa.RecordBatchReader | Iterable[pa.RecordBatch],
                    schema: pa.Schema, storage_options: StorageOptions = None,
                    max_rows_per_file: int = 1_000_000, max_bytes_per_file: int | None = None) -> list[FragmentMetadata]:
    """Write data files WITHOUT committing; the result pickles (for Ray) and goes to `replace_rows`.

    Tables are fed in ~8 MB batches: one huge batch of image blobs wrote at half the speed."""
    if isinstance(data, pa.Table):
        rows_per_batch = max(1, int(BATCH_BYTES * data.num_rows / max(1, data.nbytes)))
        reader: pa.RecordBatchReader = data.select(schema.names).cast(schema).to_reader(rows_per_batch)
    elif isinstance(data, pa.RecordBatchReader):
        reader = data
    else:
        reader = pa.RecordBatchReader.from_batches(schema, iter(data))
    with naming_full_disk(uri):
        sized = {} if max_bytes_per_file is None else {"max_bytes_per_file": max_bytes_per_file}
        return lance.fragment.write_fragments(reader, uri, schema=schema, max_rows_per_file=max_rows_per_file,
                                              storage_options=storage_options or None, **sized)


def _create(uri: str, schema: pa.Schema, fragments: Sequence[FragmentMetadata],
            storage_options: StorageOptions) -> int:
    """Create the table as version 1, exclusively.

    A plain Overwrite always wins (it would silently wipe a table another writer just created);
    with `max_retries=0` pylance 14 only commits it as version 1 and fails when any version exists.
    """
    try:
        ds = LanceDataset.commit(uri, LanceOperation.Overwrite(schema, list(fragments)),
                                 storage_options=storage_options or None, max_retries=0)
    except OSError as exc:
        if open_table(uri, storage_options) is not None:
            raise _CreationRaced(str(exc)) from exc
        raise
    if ds.version != 1:  # would mean pylance changed this behaviour: earlier versions were replaced
        log.warning("%s: creation committed as version %d, not 1", uri, ds.version)
    return ds.version


def upgrade_schema(ds: LanceDataset, schema: pa.Schema, uri: str) -> LanceDataset:
    """The table with the writer's schema: a table written before nullable columns were appended
    to its schema gains them as null columns (a metadata-only commit); any other difference is an
    error, before anything is written."""
    have = [(f.name, f.type) for f in ds.schema]
    want = [(f.name, f.type) for f in schema]
    if have == want:
        return ds
    added = list(schema)[len(have):]
    if want[:len(have)] != have or not all(f.nullable for f in added):
        raise ValueError(f"{uri}: table schema {ds.schema} differs from the writer's {schema}")
    log.warning("%s: adding the null columns %s (the table predates them)", uri, [f.name for f in added])
    ds.add_columns(added)
    return ds


def upgrade_table(uri: str, schema: pa.Schema, storage_options: StorageOptions = None) -> None:
    """Bring an existing table to `schema` before workers write fragments for it (they must
    match the table's schema)."""
    ds = open_table(uri, storage_options)
    if ds is not None:
        upgrade_schema(ds, schema, uri)


def partition_fragments(ds: LanceDataset, predicate: str) -> dict[int, int]:
    """Rows matching `predicate` per fragment id, streamed: memory grows with fragments, not rows
    (the partition columns' BITMAP indexes make this a lookup, not a scan)."""
    counts: dict[int, int] = {}
    scanner = ds.scanner(columns=[], filter=predicate, with_row_address=True, batch_size=1 << 16)
    for batch in scanner.to_batches():
        ids, n = np.unique(batch["_rowaddr"].to_numpy() >> np.uint64(32), return_counts=True)
        for frag_id, matched in zip(ids.tolist(), n.tolist()):
            counts[frag_id] = counts.get(frag_id, 0) + matched
    return counts


def fragment_identity(fragment: lance.LanceFragment) -> tuple[str, str | None]:
    """(digest of the data files, deletion file) of a fragment: what may change its rows."""
    meta = fragment.metadata
    files = hashlib.sha256("\n".join(sorted(f.path for f in meta.files)).encode()).hexdigest()[:12]
    deletion = meta.to_json().get("deletion_file")
    marker = None if not deletion else f"{deletion['read_version']}:{deletion['id']}:{deletion['num_deleted_rows']}"
    return files, marker


def partition_signature(uri: str, predicate: str, storage_options: StorageOptions = None,
                        version: int | None = None) -> str | None:
    """A digest of the fragments holding the rows matching `predicate` (ids, data files, deletions),
    None where the table does not exist. Fragments are immutable but for deletions and partitions
    never share one (prx_core.upkeep.compaction), so an equal signature means the same rows, and
    another partition's commits leave it as it was; compaction of this partition changes it. Reads
    the partition's row addresses (`partition_fragments`), never its data."""
    ds = open_table(uri, storage_options)
    if ds is None:
        return None
    if version is not None:
        ds = ds.checkout_version(version)
    fragments = sorted(partition_fragments(ds, predicate))
    identities = [(i, *fragment_identity(ds.get_fragment(i))) for i in fragments]
    return hashlib.sha256(json.dumps(identities).encode()).hexdigest()[:24]


def _plan_removal(ds: LanceDataset, predicate: str) -> tuple[list[int], list[FragmentMetadata]]:
    """Fragments to drop (every live row matches) and fragments to update with a deletion vector."""
    removed: list[int] = []
    updated: list[FragmentMetadata] = []
    for frag_id, matched in sorted(partition_fragments(ds, predicate).items()):
        fragment = ds.get_fragment(frag_id)
        meta = None if matched >= fragment.count_rows() else fragment.delete(predicate)
        if meta is None:  # every live row matches: drop the whole fragment
            removed.append(frag_id)
        else:
            updated.append(meta)
    return removed, updated


def fragment_files(uri: str, fragments: Sequence[FragmentMetadata | dict]) -> list[str]:
    """URIs of the data files of uncommitted fragments (what an abandoned attempt leaves behind)."""
    metas = [f.to_json() if isinstance(f, FragmentMetadata) else f for f in fragments]
    return ["/".join([uri.rstrip("/"), "data", file["path"]]) for meta in metas for file in meta["files"]]


def fragments_from_json(fragments: Iterable[dict]) -> list[FragmentMetadata]:
    return [FragmentMetadata.from_json(json.dumps(f)) for f in fragments]


def is_commit_conflict(exc: BaseException) -> bool:
    """Whether a failed commit lost a race to another writer: pylance raises `CommitConflictError`,
    or a plain OSError naming the conflict."""
    return isinstance(exc, CommitConflictError) or (isinstance(exc, OSError) and "onflict" in str(exc))


def backoff(attempt: int) -> None:
    """Sleep before retry `attempt`: exponential, capped at 2 s, jittered so racing writers part."""
    time.sleep(min(0.05 * 2 ** attempt, 2.0) * (0.5 + random.random()))


def replace_rows(uri: str, predicate: str, fragments: Sequence[FragmentMetadata], schema: pa.Schema,
                 storage_options: StorageOptions = None, max_retries: int = 5) -> int:
    """Remove every row matching `predicate` and add `fragments`, in ONE commit; the new version.

    `fragments` must hold exactly rows that match `predicate` (or a rerun would duplicate them).
    Lance rebases the commit over concurrent transactions that touched other fragments (e.g.
    another partition's replacement); on a real conflict (`CommitConflictError`, e.g. a compaction
    rewrote one of our fragments) the removal is re-planned against the newest version. Two writers
    of the SAME partition must not run concurrently (both would add their rows).
    """
    last: Exception | None = None
    for attempt in range(max_retries + 1):
        ds = open_table(uri, storage_options)
        try:
            if ds is None:
                fencing.ensure_held()
                return _create(uri, schema, fragments, storage_options)
            ds = upgrade_schema(ds, schema, uri)
            removed, updated = _plan_removal(ds, predicate) if predicate else ([], [])  # "": a pure append
            if not (removed or updated or fragments):
                return ds.version
            op = LanceOperation.Update(removed_fragment_ids=removed, updated_fragments=updated,
                                       new_fragments=list(fragments))
            fencing.ensure_held()  # a writer that lost its partition lock never commits
            with naming_full_disk(uri):
                return LanceDataset.commit(ds, op, read_version=ds.version).version
        except (CommitConflictError, _CreationRaced) as exc:
            last = exc
            log.info("%s: %s replacing %s (attempt %d): %s", uri, type(exc).__name__, predicate,
                     attempt + 1, exc)
            backoff(attempt)
    raise RuntimeError(f"{uri}: replacing rows where {predicate} still conflicted "
                       f"after {max_retries} retries") from last


def replace_partition(uri: str, predicate: str, table: pa.Table, schema: pa.Schema,
                      storage_options: StorageOptions = None) -> int:
    """`write_fragments` + `replace_rows`, for small tables written from the driver."""
    fragments = write_fragments(uri, table, schema, storage_options)
    return replace_rows(uri, predicate, fragments, schema, storage_options)


def _with_primary_key(schema: pa.Schema, keys: list[str]) -> pa.Schema:
    return pa.schema([f.with_nullable(False).with_metadata({**(f.metadata or {}), **PRIMARY_KEY})
                      if f.name in keys else f for f in schema], metadata=schema.metadata)


def upsert(uri: str, table: pa.Table, keys: list[str], storage_options: StorageOptions = None) -> int:
    """Insert new keys and update matched ones in one commit; never deletes (shared tables).

    The key columns are marked as Lance's unenforced primary key when the table is created:
    without it, concurrent upserts of the same new key each inserted a row (duplicates); with it
    Lance detects the conflict and retries. Keys must be non-null and unique within `table`."""
    if any(table[k].null_count for k in keys):
        raise ValueError(f"{uri}: null values in key columns {keys}")
    for attempt in range(3):
        ds = open_table(uri, storage_options)
        if ds is None:
            schema = _with_primary_key(table.schema, keys)
            try:
                return _create(uri, schema, write_fragments(uri, table, schema, storage_options), storage_options)
            except _CreationRaced:
                backoff(attempt)
                continue
        if table.num_rows == 0:
            return ds.version
        data = table.select(ds.schema.names).cast(ds.schema)
        ds.merge_insert(keys).when_matched_update_all().when_not_matched_insert_all().execute(data)
        return ds.version
    raise RuntimeError(f"{uri}: could not create or upsert the table")


def overwrite(uri: str, table: pa.Table, storage_options: StorageOptions = None) -> int:
    """Replace the whole table (small global tables such as `duplicates`); creates it if missing."""
    return lance.write_dataset(table, uri, mode="overwrite", storage_options=storage_options or None).version


def partition_digest(uri: str, predicate: str | None = None, columns: list[str] | None = None,
                     storage_options: StorageOptions = None, version: int | None = None) -> str:
    """An order-independent digest of the rows matching `predicate`: two runs that wrote the same
    rows in other fragments or another order agree. Streams, so it works on any table size."""
    import xxhash

    ds = require_table(uri, storage_options)
    if version is not None:
        ds = ds.checkout_version(version)
    total, rows = 0, 0
    for batch in ds.scanner(columns=columns, filter=predicate, batch_size=1 << 14).to_batches():
        for row in batch.to_pylist():
            total = (total + xxhash.xxh64_intdigest(repr(sorted(row.items())))) % (1 << 64)
        rows += batch.num_rows
    return f"{rows}:{total:016x}"
