"""The explorer's view of a corpus: the Lance datasets its pages query, opened at pinned versions.

Every page is a bounded query over the `explorer` table (one denormalized row per sample and
ingest reject, written per source by the `explorer` asset) and its per-source facet counts
(`explorer_facets`); `samples` serves image bytes and metadata by sample_id, the embedding tables
"more like this". Nothing corpus-sized is read into memory, so opening a view is reading a few
manifests: it is reopened when a table version moves, and the pages of one request agree with
one another because they all read the same pinned versions.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import pyarrow as pa
from lance import LanceDataset

from prx_core.store import lance_io
from prx_core.store.storage import Storage

TABLES = ("explorer", "explorer_facets", "samples", "caption_embeddings", "source_embeddings", "caption_labels")
REQUIRED = ("explorer", "explorer_facets")  # written together by the `explorer` asset
FIX = "materialize `explorer` (Dagster asset, per source) first"
VERSION_ROWS = 1000  # rows read to choose the labeler / embedder versions: a sample, never a scan
_SERIALS = itertools.count(1)
log = logging.getLogger(__name__)


@dataclass
class View:
    """The opened datasets and the model versions the explorer's rows were written with."""

    datasets: dict[str, LanceDataset]
    captioner_version: str | None
    labeler_version: str | None
    embedder_version: str | None
    rows: int  # explorer rows (a count from the manifests)
    serial: int = field(default_factory=lambda: next(_SERIALS))  # cache key: id() can be reused after GC

    @property
    def versions(self) -> dict[str, int]:
        return {name: ds.version for name, ds in self.datasets.items()}

    def table(self, name: str) -> LanceDataset | None:
        return self.datasets.get(name)

    @property
    def missing(self) -> str | None:
        """One line naming the explorer tables this corpus lacks and the fix, or None."""
        absent = [name for name in REQUIRED if name not in self.datasets]
        if not absent:
            return None
        names = " and ".join(f"`{name}`" for name in absent) + (" tables" if len(absent) > 1 else " table")
        return f"This corpus has no {names} yet: {FIX}."


def _most_common(ds: LanceDataset | None, column: str, where: str) -> str | None:
    """The most common value of `column` among the first VERSION_ROWS matching rows."""
    if ds is None or column not in ds.schema.names:
        return None
    values = ds.to_table(columns=[column], filter=where, limit=VERSION_ROWS)[column].to_pylist()
    counts = Counter(v for v in values if v)
    return counts.most_common(1)[0][0] if counts else None


def _choose_versions(datasets: dict[str, LanceDataset]) -> tuple[str | None, str | None, str | None]:
    """The captioner version of the explorer's captions (what `mds_shards` ships), and the labeler
    and embedder versions most used with it, each from a limited read."""
    captioner = _most_common(datasets.get("explorer"), "captioner_version", "captioner_version IS NOT NULL")
    if captioner is None:
        return None, None, None
    where = f"captioner_version = {lance_io.sql_literal(captioner)}"
    return (captioner, _most_common(datasets.get("caption_labels"), "labeler_version", where),
            _most_common(datasets.get("caption_embeddings"), "embedder_version", where))


def reopen(old: LanceDataset | None, uri: str, options: dict | None) -> LanceDataset | None:
    """The table's latest version, checked out from `old` where there is one: its caches (a
    full-text index is ~1.3 GB and seconds to load at 100M rows) carry over to the new version,
    and a table that did not move is the same object. A table recreated since (its versions went
    back) or gone is opened afresh."""
    if old is not None:
        try:
            latest = old.latest_version
        except (OSError, ValueError):  # removed meanwhile
            latest = None
        if latest == old.version:
            return old
        if latest is not None and latest > old.version:
            return old.checkout_version(latest)
    return lance_io.open_table(uri, options)


def open_view(storage: Storage, previous: View | None = None) -> View:
    """Every table the pages read, at its latest version (absent ones left out), reusing the
    caches of `previous` (the view it replaces)."""
    options = storage.lance_storage_options()
    old = previous.datasets if previous is not None else {}
    datasets = {name: ds for name in TABLES
                if (ds := reopen(old.get(name), storage.lance_uri(name), options)) is not None}
    explorer = datasets.get("explorer")
    return View(datasets, *_choose_versions(datasets), rows=explorer.count_rows() if explorer is not None else 0)


def current_versions(storage: Storage) -> tuple:
    """What a view depends on: the version of every table it opens (skip lists are in `explorer`)."""
    options = storage.lance_storage_options()
    return tuple((name, lance_io.table_version(storage.lance_uri(name), options)) for name in TABLES)


class ViewCache:
    """The current view. Versions are checked at most every `ttl` seconds, and the view reopened
    only when one moved (so per-view caches stay warm). Only the first open blocks a request:
    later checks run on one background thread while pages keep the previous view. A failed
    reopen keeps the old view and is reported in `status()` (its type only: the details, which
    name paths, go to the log); the next check retries it."""

    def __init__(self, storage: Storage, ttl: float = 5.0) -> None:
        self.storage, self.ttl = storage, ttl
        self._lock = threading.Lock()
        self._view: View | None = None
        self._key: tuple | None = None
        self._checked = 0.0
        self._refreshing = False
        self._error: str | None = None

    def get(self) -> View:
        with self._lock:
            if self._view is None:  # nothing to show yet: this request waits for the first open
                self._key, self._view = current_versions(self.storage), open_view(self.storage)
                self._checked = time.monotonic()
            view = self._view
            if time.monotonic() - self._checked < self.ttl or self._refreshing:
                return view
            self._checked, self._refreshing = time.monotonic(), True
        threading.Thread(target=self._refresh, name="explorer-view", daemon=True).start()
        return view

    def status(self) -> dict[str, object]:
        """For /healthz: whether a refresh is running and why the last one failed, if it did."""
        with self._lock:
            return {"refreshing": self._refreshing, "refresh_error": self._error}

    def _refresh(self) -> None:
        try:
            key = current_versions(self.storage)  # read first: a table moving mid-open is caught next time
            if key != self._key:
                view = open_view(self.storage, self._view)
                with self._lock:
                    self._key, self._view = key, view
            self._error = None
        except Exception as exc:  # keep serving the old view; the next check tries again
            log.exception("reopening the explorer's tables failed")  # the details: paths, store errors
            self._error = f"the last refresh failed ({type(exc).__name__}); the details are in the explorer log"
        finally:
            with self._lock:
                self._refreshing = False


def in_list(column: str, keys: list[str]) -> str:
    """`column IN (...)` of quoted literals (a page's or a lookup's worth of keys)."""
    return f"{column} IN ({', '.join(lance_io.sql_literal(k) for k in keys)})" if keys else "false"


def both(*parts: str | None) -> str | None:
    """The conjunction of the filters given (None when there are none)."""
    given = [p for p in parts if p]
    return " AND ".join(f"({p})" for p in given) if given else None


def rows_by_key(ds: LanceDataset | None, column: str, keys: list[str], columns: list[str],
                where: str | None = None) -> pa.Table:
    """Rows whose `column` is one of `keys` (BTREE lookups), in any order."""
    if ds is None or not keys:
        return pa.table({c: pa.array([], pa.string()) for c in columns})
    return ds.to_table(columns=columns, filter=both(in_list(column, keys), where))


def one_row(ds: LanceDataset | None, column: str, key: str, columns: list[str] | None = None) -> dict | None:
    """The first row whose `column` is `key` (a BTREE lookup), or None."""
    if ds is None:
        return None
    found = ds.to_table(columns=columns, filter=f"{column} = {lance_io.sql_literal(key)}", limit=1).to_pylist()
    return found[0] if found else None


def versions_filter(view: View, embeddings: bool = False) -> str:
    """The Lance filter for rows of the captioner (and, with `embeddings`, embedder) version the view chose."""
    where = f"captioner_version = {lance_io.sql_literal(view.captioner_version or '')}"
    if embeddings and view.embedder_version:
        where += f" AND embedder_version = {lance_io.sql_literal(view.embedder_version)}"
    return where
