"""Batched appends to the shared, content-keyed tables (`captions`, `caption_labels`,
`caption_embeddings`): how hours of model work reach Lance in a few commits and survive a crash.

Workers write each unit's rows as uncommitted fragments and list them in the unit's summary. The
driver appends them every `every_units` units or `every_seconds`, whichever comes first, so the
number of table versions grows with hours, not rows, and a crash loses only the units in flight:
on the rerun, `commit_recorded` first appends what recorded units wrote but no commit took (a
fragment whose data file the table already holds is never appended twice).

A unit may also list `retry` keys: contents it computed again because the stored row was a
failure; their failed rows are deleted in the same flush, just before the append.

Every `index_every` appends the table's indexes are caught up (a delta segment, on a worker):
the units that follow look their keys up in what the run appended before them (captions reused
across sources, labels and embeddings by content id), and an unindexed fragment costs a scan of
its rows per lookup: quadratic in the run when only `finish` indexed (1.2e12 row scans for the
labels of one 100M-row source).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from lance.fragment import FragmentMetadata

from prx_core.compute.parallel import run_on_worker
from prx_core.store import fencing, lance_io, maintenance, schemas
from prx_core.store.storage import Storage

EVERY_UNITS = 64
EVERY_SECONDS = 300.0
INDEX_EVERY = 4  # appends between index catch-ups: ~256 units of rows unindexed at most


class BatchedAppend:
    """Collects unit summaries and appends their fragments to one shared table in few commits."""

    def __init__(self, storage: Storage, table: str, *, every_units: int = EVERY_UNITS,
                 every_seconds: float = EVERY_SECONDS,
                 failed_rows: Callable[[Sequence[str]], str] | None = None, refresh_indexes: bool = True,
                 index_every: int = INDEX_EVERY) -> None:
        self.storage, self.table = storage, table
        self.uri, self.options = storage.lance_uri(table), storage.lance_storage_options()
        self.every_units, self.every_seconds = every_units, every_seconds
        self.failed_rows = failed_rows  # predicate of the stored failures of the given keys
        self.refresh_indexes = refresh_indexes  # False: the stage indexes the table itself
        self.index_every = index_every
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
            if self.refresh_indexes and self.appends % self.index_every == 0:
                self.index()
        self.pending = []
        return self.version

    def index(self) -> None:
        """Index what is appended (a delta segment), on a worker: index memory grows with the table."""
        self.version = run_on_worker(maintenance.refresh_table_indexes, self.uri, self.table, self.options).version

    def finish(self) -> int | None:
        """Flush, then index the new fragments (a delta segment); the version readers see."""
        self.flush()
        if self.refresh_indexes and lance_io.table_exists(self.uri, self.options):
            self.index()
        return self.version


def append_fragments(uri: str, fragments: Sequence[FragmentMetadata], schema: Any,
                     storage_options: lance_io.StorageOptions = None) -> int:
    """Append uncommitted fragments in one commit (creating the table); Lance rebases the append
    over concurrent commits, since appends touch no existing fragment."""
    return lance_io.replace_rows(uri, "", fragments, schema, storage_options)


def keys_predicate(column: str, keys: Sequence[str], extra: str = "") -> str:
    listed = ", ".join(lance_io.sql_literal(k) for k in keys)
    return f"{column} IN ({listed})" + (f" AND ({extra})" if extra else "")
