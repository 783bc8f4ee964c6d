"""Takedowns that finish: `opt-out --delete-bytes --purge` removes every copy under the root now.

What a takedown deleted is recorded (`prx_core.stages.opt_out.takedowns`: the ids, and the contents they
held), so a purge acts on the record, not on what still matches: a second run with `--purge` after
a first without it purges what the first deleted. Per source, under its partition locks:

- MDS: every superseded chunk folder (and its copy in a merged stream) whose chunk record holds a
  taken-down id is removed now;
- the per-source tables keyed by `sample_id` (`PER_SOURCE_TABLES`, `mds_index` included): the
  source's fragments holding deleted rows are rewritten without them;
- the tables keyed by content (`CONTENT_TABLES`): the rows of a taken-down content that no sample
  of any source holds any more (and of the caption keys made from it) are deleted;
- the source's staged joins (`_state/joins/<source>`): the taken-down keys' rows are deleted;
- every table touched gets its indexes rebuilt from its rows (an index segment holds the keys it
  indexed, deleted or not) and every older version removed, except the versions an uncommitted
  attempt under `_runs/` pins: those still hold the rows. Each is named with its attempt, and the
  takedown is incomplete (`PurgeReport.complete`) until `discard_attempts` (the source's own
  abandoned attempts, removed under its locks) or that attempt's next run.

The cost is one rewrite of the fragments holding deleted rows, and one index build per touched
table (proportional to the table: a full-text index of 100M rows takes hours; batch takedowns).
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from datetime import timedelta

import pyarrow as pa
import pyarrow.compute as pc

from prx_core.shards.mds.retention import SUPERSEDED, read_superseded
from prx_core.shards.mds.rewrite import remove_superseded_now
from prx_core.shards.mds.streams import read_chunk_record
from prx_core.stages.opt_out.takedowns import taken_down_contents, taken_down_ids
from prx_core.store import fencing, lance_io
from prx_core.store.maintenance import refresh_table_indexes
from prx_core.store.partitions import source_predicate
from prx_core.store.retention import cleanup_superseded, pinned_versions
from prx_core.store.storage import RUNS, Storage, join_uri
from prx_core.upkeep.appends import keys_predicate

PER_SOURCE_TABLES = ("samples", "buckets", "phashes", "source_embeddings", "explorer", "mds_index")
CONTENT_TABLES = ("captions", "caption_labels", "caption_embeddings", "text_latents")
IN_LIST = 1000  # keys per delete predicate


@dataclass
class PinnedVersion:
    """A version kept because an uncommitted attempt reads it: it still holds the deleted rows."""

    table: str
    version: int
    attempts: list[str]  # `_runs/<asset>/<partition>/<digest>`

    def line(self) -> str:
        return f"{self.table} version {self.version}, pinned by {', '.join(self.attempts)}"


@dataclass
class PurgeReport:
    chunks: list[str] = field(default_factory=list)  # superseded chunk folders removed
    versions: dict[str, int] = field(default_factory=dict)  # table -> old versions removed
    content_rows: dict[str, int] = field(default_factory=dict)  # content-keyed table -> rows deleted
    join_rows: int = 0  # staged join rows deleted
    indexes_rebuilt: list[str] = field(default_factory=list)  # tables whose indexes were rebuilt
    pinned: list[PinnedVersion] = field(default_factory=list)
    discarded: list[str] = field(default_factory=list)  # abandoned attempts removed

    @property
    def complete(self) -> bool:
        return not self.pinned


def purge_source(storage: Storage, source: str, discard: bool, assets: list[str], report: PurgeReport) -> None:
    """Purge what the source's recorded takedowns deleted; the caller holds the locks of `assets`
    (with `discard`, the source's attempts of those assets are discarded first)."""
    ids = taken_down_ids(storage, source)
    if not len(ids):
        return
    if discard:
        report.discarded += discard_attempts(storage, source, assets)
    report.chunks += purge_chunks(storage, source, ids)
    touched = [t for t in PER_SOURCE_TABLES if rewrite_deleted(storage, t, source_predicate(source))]
    contents = orphaned_contents(storage, taken_down_contents(storage, source))
    for table in CONTENT_TABLES:
        deleted = delete_keyed(storage, table, "content_id", contents)
        if deleted:
            report.content_rows[table] = report.content_rows.get(table, 0) + deleted
            rewrite_deleted(storage, table, None)
            touched.append(table)
    report.join_rows += purge_joins(storage, source, ids)
    pins = pinned_versions(storage)
    for table in dict.fromkeys([*PER_SOURCE_TABLES, *touched]):
        uri, options = storage.lance_uri(table), storage.lance_storage_options()
        if (ds := lance_io.open_table(uri, options)) is None:
            continue
        if table in touched or stale_segments(ds):
            rebuild_indexes(uri, table, options)
            report.indexes_rebuilt.append(table)
        cleanup = cleanup_superseded(lance_io.require_table(uri, options), timedelta(0), pins.get(table, ()))
        report.versions[table] = report.versions.get(table, 0) + cleanup.removed
        report.pinned += [PinnedVersion(table, v, pinning_attempts(storage, table, v)) for v in cleanup.kept_pinned]
        del ds


def purge_chunks(storage: Storage, source: str, ids: pa.Array) -> list[str]:
    """Superseded chunk folders (the source's and its merged copies) whose records hold one of `ids`."""
    fs, removed = storage.filesystem(), []
    fs.invalidate_cache()
    base = storage.uri("mds").rstrip("/")
    records = sorted(fs.glob(f"{base}/{source}/*/*/{SUPERSEDED}")) + sorted(fs.glob(f"{base}/_merged/*/*/{SUPERSEDED}"))
    for record in records:
        stream = posixpath.dirname(record)
        merged = "/_merged/" in stream
        names = [n for n in read_superseded(fs, stream) if not merged or n.startswith(f"{source}.")]
        hit = [n for n in names if fs.isdir(join_uri(stream, n)) and holds_any(join_uri(stream, n), ids, storage)]
        if hit:
            removed += remove_superseded_now(storage, stream, hit)
    return removed


def holds_any(folder: str, ids: pa.Array, storage: Storage) -> bool:
    try:
        stored = read_chunk_record(folder, storage.storage_options)["sample_id"]
    except (FileNotFoundError, OSError, KeyError):
        return True  # a chunk whose record is gone cannot be cleared: it goes
    return bool(pc.any(pc.is_in(stored, value_set=ids)).as_py())


def rewrite_deleted(storage: Storage, table: str, predicate: str | None) -> bool:
    """Rewrite the fragments holding deleted rows (of `predicate`'s partition: never mixing
    partitions), one commit; whether any was. The deleted rows' bytes leave the data files."""
    from lance import LanceDataset, LanceOperation

    from prx_core.upkeep.compaction import fragment_keys, rewrite_partition

    uri, options = storage.lance_uri(table), storage.lance_storage_options()
    ds = lance_io.open_table(uri, options)
    if ds is None:
        return False
    source = predicate.split("'")[1] if predicate else None
    ids = [f.fragment_id for f in ds.get_fragments() if f.metadata.num_deletions
           and (source is None or fragment_keys(ds, f.fragment_id, ["source"]) == {(source,)})]
    if not ids:
        return False
    new = lance_io.fragments_from_json(rewrite_partition(uri, ds.version, ids, predicate, 1_000_000, options))
    fencing.ensure_held()
    LanceDataset.commit(ds, LanceOperation.Update(removed_fragment_ids=ids, new_fragments=new), read_version=ds.version)
    return True


def orphaned_contents(storage: Storage, contents: list[str]) -> list[str]:
    """The contents no sample holds any more, with the caption keys a source caption made of them."""
    if not contents:
        return []
    from prx_core.store.lookups import lookup_keys

    options, held = storage.lance_storage_options(), set()
    if lance_io.open_table(storage.lance_uri("buckets"), options) is not None:  # every sample, content-indexed
        held = set(lookup_keys(storage.lance_uri("buckets"), "content_id", contents, ["content_id"],
                               storage_options=options)["content_id"].to_pylist())
    elif (samples := lance_io.open_table(storage.lance_uri("samples"), options)) is not None:
        for at in range(0, len(contents), IN_LIST):
            held.update(samples.to_table(columns=["content_id"], filter=keys_predicate("content_id", contents[at:at + IN_LIST]))
                        ["content_id"].to_pylist())
    orphans = [c for c in contents if c not in held]
    captions = lance_io.open_table(storage.lance_uri("captions"), options)
    if orphans and captions is not None and "image_content_id" in captions.schema.names:
        contents = list(orphans)
        for at in range(0, len(contents), IN_LIST):  # a source caption's key: sha256(domain, content, its text)
            keys = captions.to_table(columns=["content_id"], filter=keys_predicate("image_content_id", contents[at:at + IN_LIST]))
            orphans += [k for k in keys["content_id"].to_pylist() if k not in orphans]
    return orphans


def delete_keyed(storage: Storage, table: str, column: str, keys: list[str]) -> int:
    ds = lance_io.open_table(storage.lance_uri(table), storage.lance_storage_options())
    if ds is None or not keys:
        return 0
    before = ds.count_rows()
    for at in range(0, len(keys), IN_LIST):
        fencing.ensure_held()
        ds.delete(keys_predicate(column, keys[at:at + IN_LIST]))
    return before - lance_io.require_table(storage.lance_uri(table), storage.lance_storage_options()).count_rows()


def purge_joins(storage: Storage, source: str, ids: pa.Array) -> int:
    """Delete the taken-down keys' rows from the source's staged joins, rewrite, keep no old version."""
    import lance

    from prx_core.stages.samples.join_tables import STATE

    fs, folder, deleted = storage.filesystem(), storage.uri(*STATE, source), 0
    fs.invalidate_cache()
    keys = [i[len(source) + 1:] for i in ids.to_pylist()]
    for path in fs.ls(folder, detail=False) if fs.exists(folder) else []:
        uri = path if "://" in path or not storage.is_remote else f"{storage.root.split('://')[0]}://{path}"
        ds = lance.dataset(uri, storage_options=storage.lance_storage_options() or None)
        before = ds.count_rows()
        for at in range(0, len(keys), IN_LIST):
            ds.delete(keys_predicate("key", keys[at:at + IN_LIST]))
        ds = lance.dataset(uri, storage_options=storage.lance_storage_options() or None)
        if ds.count_rows() < before:
            deleted += before - ds.count_rows()
            ds.optimize.compact_files(materialize_deletions_threshold=0.0)
            ds = lance.dataset(uri, storage_options=storage.lance_storage_options() or None)
            for index in ds.describe_indices():  # its BTREE holds the keys: built again
                ds.create_scalar_index(index.field_names[0], "BTREE", name=index.name, replace=True)
            ds = lance.dataset(uri, storage_options=storage.lance_storage_options() or None)
            ds.cleanup_old_versions(older_than=timedelta(0), error_if_tagged_old_versions=False)
    return deleted


def stale_segments(ds: object) -> bool:
    """An index segment still covers a fragment the table no longer has (replaced rows: its pages
    hold their keys)."""
    live = {f.fragment_id for f in ds.get_fragments()}
    return any(int(i) not in live for index in ds.describe_indices() for seg in index.segments for i in seg.fragment_ids)


def rebuild_indexes(uri: str, table: str, options: dict | None) -> None:
    """Drop every index of the table and build them again from its rows (`refresh_table_indexes`)."""
    ds = lance_io.require_table(uri, options)
    for index in ds.describe_indices():
        ds.drop_index(index.name)
    refresh_table_indexes(uri, table, options)


def discard_attempts(storage: Storage, source: str, assets: list[str]) -> list[str]:
    """Remove the source's uncommitted attempts of `assets` (their locks held: none is running)."""
    from prx_core.compute.attempts import discard_attempt

    fs, removed = storage.filesystem(), []
    fs.invalidate_cache()
    for asset in assets:
        base = storage.uri(RUNS, asset, source)
        for attempt in sorted(fs.ls(base, detail=False)) if fs.exists(base) else []:
            discard_attempt(fs, attempt)
            removed.append(f"{RUNS}/{asset}/{source}/{posixpath.basename(attempt.rstrip('/'))}")
    return removed


def pinning_attempts(storage: Storage, table: str, version: int) -> list[str]:
    """The uncommitted attempts whose run.json pins `table` at `version` (as `_runs/...` paths)."""
    import json

    from prx_core.store.storage import COMMITTED

    fs, found = storage.filesystem(), []
    base = storage.uri(RUNS).rstrip("/")
    for path in sorted(fs.glob(f"{base}/*/*/*/run.json")):
        attempt = path.rsplit("/", 1)[0]
        if fs.exists(f"{attempt}/{COMMITTED}"):
            continue
        inputs = json.loads(fs.cat_file(path))["manifest"]["inputs"]
        if inputs.get(table) == version:
            found.append(RUNS + "/" + "/".join(attempt.rstrip("/").split("/")[-3:]))
    return found
