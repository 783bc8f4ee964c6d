"""Batched appends to the shared, content-keyed tables (`captions`, `caption_labels`,
`caption_embeddings`): how hours of model work reach Lance in a few commits and survive a crash.

Workers write each unit's rows as uncommitted fragments and list them in the unit's summary. The
driver appends them every `every_units` units or `every_seconds`, whichever comes first, so the
number of table versions grows with hours, not rows, and a crash loses only the units in flight:
on the rerun, `commit_recorded` first appends what recorded units wrote but no commit took (a
fragment whose data file the table already holds is never appended twice).

A unit may also list `retry` keys: contents it computed again because the stored row was a
failure; their failed rows are deleted in the same flush, just before the append.

Every `index_every` appends the fragments the run appended since the last time are first merged
into fragments of up to `merge_rows` (1M) rows, on a worker: units of 4,096 rows would otherwise
leave a shared table with a fragment per unit (~244k at 1B rows, a 23 MB manifest read at every
open). Then the table's indexes are caught up on a worker (the keys' BTREE within a bounded
number of segments, prx_core.store.segments):
the units that follow look their keys up in what the run appended before them (captions reused
across sources, labels and embeddings by content id), and an unindexed fragment costs a scan of
its rows per lookup: quadratic in the run when only `finish` indexed (1.2e12 row scans for the
labels of one 100M-row source).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

from lance.fragment import FragmentMetadata

from prx_core.store import fencing, lance_io, schemas
from prx_core.store.storage import Storage
from prx_core.upkeep.compaction import rewrite_partition
from prx_core.upkeep.indexing import index_table, on_worker

EVERY_UNITS = 64
EVERY_SECONDS = 300.0
INDEX_EVERY = 4  # appends between index catch-ups: ~256 units of rows unindexed at most
MERGE_ROWS = 1_000_000  # rows per fragment the appended fragments are merged into (the table rule)


class BatchedAppend:
    """Collects unit summaries and appends their fragments to one shared table in few commits."""

    def __init__(self, storage: Storage, table: str, *, every_units: int = EVERY_UNITS,
                 every_seconds: float = EVERY_SECONDS,
                 failed_rows: Callable[[Sequence[str]], str] | None = None, refresh_indexes: bool = True,
                 index_every: int = INDEX_EVERY, merge_rows: int = MERGE_ROWS) -> None:
        self.storage, self.table = storage, table
        self.uri, self.options = storage.lance_uri(table), storage.lance_storage_options()
        self.every_units, self.every_seconds = every_units, every_seconds
        self.failed_rows = failed_rows  # predicate of the stored failures of the given keys
        self.refresh_indexes = refresh_indexes  # False: the stage indexes the table itself
        self.index_every = index_every
        self.merge_rows = merge_rows  # 0: never merge (each unit's fragment stays)
        self.unmerged: set[str] = set()  # data files this run appended since the last merge
        self.merges = 0
        self.appends = 0  # appends this run: every `index_every`-th catches the indexes up
        self.pending: list[dict[str, Any]] = []
        self.last = time.monotonic()
        self.commits = 0
        self.version: int | None = lance_io.table_version(self.uri, self.options)

    def add(self, summary: dict[str, Any]) -> None:
        if summary.get("fragments") or summary.get("retry"):
            self.pending.append(summary)
        if len(self.pending) >= self.every_units or (self.pending and time.monotonic() - self.last >= self.every_seconds):
            self.flush()

    def commit_recorded(self, summaries: Iterable[dict[str, Any]]) -> None:
        """Append what earlier attempts' recorded units wrote and no commit took (after a crash)."""
        summaries = [s for s in summaries if s.get("fragments")]
        if not summaries:
            return
        ds = lance_io.open_table(self.uri, self.options)
        held = {f.path for fragment in ds.get_fragments() for f in fragment.data_files()} if ds is not None else set()
        for summary in summaries:
            fresh = [f for f in summary["fragments"] if not {d["path"] for d in f["files"]} & held]
            if fresh:
                self.pending.append({**summary, "fragments": fresh})
        self.flush()

    def flush(self) -> int | None:
        """One append of everything pending (after deleting the failures it replaces)."""
        self.last = time.monotonic()
        if not self.pending:
            return self.version
        fragments = lance_io.fragments_from_json(f for s in self.pending for f in s.get("fragments") or [])
        retry = sorted({k for s in self.pending for k in s.get("retry") or []})
        if retry and self.failed_rows is not None and (ds := lance_io.open_table(self.uri, self.options)) is not None:
            fencing.ensure_held()  # the deletes commit too (the append is fenced in replace_rows)
            for start in range(0, len(retry), 5_000):
                ds.delete(self.failed_rows(retry[start:start + 5_000]))
            self.commits += 1
        if fragments:
            self.version = append_fragments(self.uri, fragments, schemas.TABLES[self.table], self.options)
            self.commits += 1
            self.appends += 1
            self.unmerged |= {d["path"] for f in fragments for d in f.to_json()["files"]}
            if self.appends % self.index_every == 0:
                self.merge()
                if self.refresh_indexes:
                    self.index()
        self.pending = []
        return self.version

    def merge(self) -> None:
        """The fragments appended since the last merge, rewritten on a worker into fragments of up
        to `merge_rows` rows, one commit. Losing a race to a concurrent writer leaves them as they
        are (compact_corpus merges them later): merging only saves reads."""
        paths, self.unmerged = self.unmerged, set()
        if not self.merge_rows or len(paths) < 2:
            return
        merged = merge_fragments(self.uri, paths, self.merge_rows, self.options)
        if merged is not None:
            self.version, self.merges, self.commits = merged, self.merges + 1, self.commits + 1

    def index(self) -> None:
        """Index what is appended (folded into the newest segments), on a worker: index memory grows with the table."""
        self.version = index_table(self.uri, self.table, self.options).version

    def finish(self) -> int | None:
        """Flush, merge, then index the new fragments (a delta segment); the version readers see."""
        self.flush()
        self.merge()
        if self.refresh_indexes and lance_io.table_exists(self.uri, self.options):
            self.index()
        return self.version


def merge_fragments(uri: str, paths: Collection[str], target_rows: int,
                    storage_options: lance_io.StorageOptions = None) -> int | None:
    """The table's fragments made only of the data files `paths` (what one run appended),
    rewritten into fragments of up to `target_rows` rows (by a Ray task when a cluster is up: the
    rows never pass through the driver) and committed in their place, under the run's lock; the
    new version, or None when there was nothing to merge or a concurrent commit won."""
    from lance import LanceDataset, LanceOperation

    ds, ours = lance_io.require_table(uri, storage_options), set(paths)
    ids = [f.fragment_id for f in ds.get_fragments() if {d.path for d in f.data_files()} <= ours]
    if len(ids) < 2:
        return None
    new = lance_io.fragments_from_json(on_worker(rewrite_partition, uri, ds.version, ids, None, target_rows,
                                                 storage_options))
    fencing.ensure_held()
    try:
        merged = LanceDataset.commit(uri, LanceOperation.Update(removed_fragment_ids=ids, new_fragments=new),
                                     read_version=ds.version, storage_options=storage_options or None)
    except OSError as exc:  # another writer touched these fragments
        if not lance_io.is_commit_conflict(exc):
            raise
        return None
    return merged.version


def append_fragments(uri: str, fragments: Sequence[FragmentMetadata], schema: Any,
                     storage_options: lance_io.StorageOptions = None) -> int:
    """Append uncommitted fragments in one commit (creating the table); Lance rebases the append
    over concurrent commits, since appends touch no existing fragment."""
    return lance_io.replace_rows(uri, "", fragments, schema, storage_options)


def keys_predicate(column: str, keys: Sequence[str], extra: str = "") -> str:
    listed = ", ".join(lance_io.sql_literal(k) for k in keys)
    return f"{column} IN ({listed})" + (f" AND ({extra})" if extra else "")
