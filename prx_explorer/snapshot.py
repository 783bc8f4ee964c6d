"""One in-memory view of the corpus tables at pinned Lance versions, rebuilt when they move.

Filters (source, label, tier, bucket, duplicate group, skip and reject reasons) span seven
tables; joining their small scalar columns once into a pandas frame makes every filter,
facet count and page a vectorized mask instead of a multi-table query. Large columns (image
bytes, caption text, vectors, the metadata maps) stay in Lance and are read for one page at a
time; of the metadata the frame keeps only the bounded `label` value (`meta_label`, for facets).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow as pa
from lance import LanceDataset

from prx_core.shards.skiplists import read_skip_lists
from prx_core.store import lance_io
from prx_core.store.storage import Storage
from prx_core.stages.explorer_rows import facet_labels, label_expression

TABLES = ("samples", "rejects", "buckets", "phashes", "duplicates", "captions", "caption_labels", "mds_index",
          "caption_embeddings", "source_embeddings")
SAMPLE_COLUMNS = ["sample_id", "content_id", "source", "source_key", "width", "height", "format", "jpeg_quality",
                  "num_bytes"]
# content_id too: few repeats, but isin/map then hash the values once, not a million strings per query
CATEGORICAL = ["source", "format", "label", "bucket", "reject_reason", "reject_stage", "skip_reason", "caption_error",
               "content_id", "meta_label"]
_SERIALS = itertools.count(1)
log = logging.getLogger(__name__)
REJECT_COLUMNS = ["sample_id", "source", "source_key", "content_id", "stage", "reason", "message", "width", "height"]


@dataclass
class Snapshot:
    """The joined frame (one row per sample or ingest reject, indexed by sample_id) and the
    datasets it was read from, pinned so page reads agree with the frame."""

    frame: pd.DataFrame
    datasets: dict[str, LanceDataset]
    captioner_version: str | None
    labeler_version: str | None
    embedder_version: str | None
    serial: int = field(default_factory=lambda: next(_SERIALS))  # cache key: id() can be reused after GC

    @property
    def versions(self) -> dict[str, int]:
        return {name: ds.version for name, ds in self.datasets.items()}

    def table(self, name: str) -> LanceDataset | None:
        return self.datasets.get(name)


def _read(ds: LanceDataset | None, columns: list[str], where: str | None = None, **kwargs: object) -> pd.DataFrame:
    if ds is None:
        return pd.DataFrame(columns=columns)
    present = [c for c in columns if c in ds.schema.names]
    table = ds.to_table(columns=present, filter=where, **kwargs)
    return table.to_pandas()


def _read_samples(ds: LanceDataset | None) -> pd.DataFrame:
    """The samples' scalar columns with their row addresses (`rowaddr`) and `meta_label`."""
    if ds is None:
        return pd.DataFrame(columns=SAMPLE_COLUMNS)
    columns = {c: c for c in SAMPLE_COLUMNS if c in ds.schema.names} | label_expression(ds.schema)
    table = ds.to_table(columns=columns, with_row_address=True)
    labels = facet_labels(table["meta_label"] if "meta_label" in table.column_names else None, table.num_rows)
    table = table.drop_columns([c for c in ("meta_label",) if c in table.column_names]).append_column("meta_label", labels)
    return table.to_pandas().rename(columns={"_rowaddr": "rowaddr"})


def _most_common(values: pd.Series) -> str | None:
    counts = Counter(v for v in values if isinstance(v, str) and v)
    return counts.most_common(1)[0][0] if counts else None


def _skip_reasons(storage: Storage) -> pd.Series:
    """sample_id -> comma-joined skip reasons, from the skip-list files the trainer reads."""
    reasons: dict[str, list[str]] = {}
    for skip in read_skip_lists(storage.root, None, storage.storage_options):
        for sample_id in skip.sample_ids:
            reasons.setdefault(sample_id, []).append(skip.reason)
    return pd.Series({k: ",".join(sorted(v)) for k, v in reasons.items()}, dtype="object", name="skip_reason")


def _choose_versions(datasets: dict[str, LanceDataset]) -> tuple[str | None, str | None, str | None]:
    """The captioner version the MDS was written with (else the most common captioned one), and
    the labeler / embedder versions most used with it: what the corpus actually ships."""
    captioner = _most_common(_read(datasets.get("mds_index"), ["captioner_version"]).get("captioner_version", pd.Series()))
    if captioner is None:
        captions = _read(datasets.get("captions"), ["captioner_version"], "error = ''")
        captioner = _most_common(captions.get("captioner_version", pd.Series()))
    if captioner is None:
        return None, None, None
    where = f"captioner_version = {lance_io.sql_literal(captioner)}"
    labeler = _most_common(_read(datasets.get("caption_labels"), ["labeler_version"], where).get("labeler_version", pd.Series()))
    embedder = _most_common(_read(datasets.get("caption_embeddings"), ["embedder_version"], where)
                            .get("embedder_version", pd.Series()))
    return captioner, labeler, embedder


def _left(frame: pd.DataFrame, other: pd.DataFrame, on: str) -> pd.DataFrame:
    other = other.drop_duplicates(on)
    return frame.merge(other, how="left", on=on) if len(other.columns) > 1 else frame


def build_snapshot(storage: Storage) -> Snapshot:
    options = storage.lance_storage_options()
    datasets = {name: ds for name in TABLES if (ds := lance_io.open_table(storage.lance_uri(name), options)) is not None}
    captioner, labeler, embedder = _choose_versions(datasets)
    samples = _read_samples(datasets.get("samples"))
    rejects = _read(datasets.get("rejects"), REJECT_COLUMNS)
    # An ingest reject has no samples row; a later-stage reject (buckets) does: keep one row each.
    ingest_only = rejects[~rejects["sample_id"].isin(samples["sample_id"])]
    frame = pd.concat([samples, ingest_only[[c for c in SAMPLE_COLUMNS if c in ingest_only.columns]]], ignore_index=True)
    reasons = rejects.groupby("sample_id").agg(reject_reason=("reason", "first"), reject_stage=("stage", "first"),
                                               reject_message=("message", "first")).reset_index()
    frame = _left(frame, reasons, "sample_id")
    frame = _left(frame, _read(datasets.get("buckets"), ["sample_id", "tier", "bucket"]), "sample_id")
    phashes = _read(datasets.get("phashes"), ["sample_id", "phash"])
    phashes["phash"] = [f"{int(h):016x}" for h in phashes["phash"]]  # before the join can turn uint64 into float
    frame = _left(frame, phashes, "sample_id")
    frame = _left(frame, _read(datasets.get("duplicates"), ["sample_id", "group_id", "group_size", "keeper",
                                                            "keeper_sample_id"]), "sample_id")
    if captioner is not None:
        where = f"captioner_version = {lance_io.sql_literal(captioner)}"
        captions = _read(datasets.get("captions"), ["content_id", "word_count", "error"], where, with_row_address=True)
        frame = _left(frame, captions.rename(columns={"error": "caption_error", "_rowaddr": "caption_rowaddr"}),
                      "content_id")
        if labeler is not None:
            where_label = f"{where} AND labeler_version = {lance_io.sql_literal(labeler)}"
            frame = _left(frame, _read(datasets.get("caption_labels"), ["content_id", "label", "score"], where_label),
                          "content_id")
    frame = _left(frame, _read(datasets.get("mds_index"), ["sample_id", "index"]).rename(columns={"index": "mds_index"}),
                  "sample_id")
    clip = _read(datasets.get("source_embeddings"), ["sample_id"], with_row_address=True)
    frame = _left(frame, clip.rename(columns={"_rowaddr": "clip_rowaddr"}), "sample_id")
    skip = _skip_reasons(storage)
    frame["skip_reason"] = frame["sample_id"].map(skip) if len(skip) else None
    for column in ("label", "tier", "bucket", "group_id", "reject_reason", "reject_stage", "reject_message", "word_count",
                   "score", "mds_index", "caption_error", "format", "caption_rowaddr", "clip_rowaddr", "meta_label"):
        if column not in frame.columns:
            frame[column] = None
    frame["tier"] = pd.to_numeric(frame["tier"], errors="coerce").astype("Int32")
    for column in CATEGORICAL:  # few distinct values: masks and counts work on codes, not strings
        frame[column] = frame[column].astype("category")
    frame = frame.sort_values(["source", "sample_id"], kind="stable").set_index("sample_id", drop=False)
    frame.index = frame.index.astype(object)  # hashed lookups: Arrow-string isin was 0.5 s at 100k rows
    frame.index.name = None  # the column stays the one name for sorts and merges
    return Snapshot(frame, datasets, captioner, labeler, embedder)


def current_versions(storage: Storage) -> tuple:
    """What a snapshot depends on: every table version and the skip-list files' names and sizes."""
    options = storage.lance_storage_options()
    versions = tuple((name, lance_io.table_version(storage.lance_uri(name), options)) for name in TABLES)
    fs = storage.filesystem()
    try:
        files = fs.find(storage.uri("skiplists"), detail=True) if fs.exists(storage.uri("skiplists")) else {}
    except FileNotFoundError:
        files = {}
    return versions + tuple(sorted((path, info.get("size")) for path, info in files.items()))


class SnapshotCache:
    """The current snapshot. Versions are checked at most every `ttl` seconds, and a snapshot is
    rebuilt only when one moved. Only the first build blocks a request: later checks and rebuilds
    run on one background thread while pages keep the previous snapshot (a rebuild takes ~10 s
    at a million rows, and a backfill moves tables every few seconds). A failed rebuild keeps the
    old snapshot and is reported in `status()` (its type only: the details, which name paths, go to
    the log); the next check retries it."""

    def __init__(self, storage: Storage, ttl: float = 5.0) -> None:
        self.storage, self.ttl = storage, ttl
        self._lock = threading.Lock()
        self._snapshot: Snapshot | None = None
        self._key: tuple | None = None
        self._checked = 0.0
        self._refreshing = False
        self._error: str | None = None

    def get(self) -> Snapshot:
        with self._lock:
            if self._snapshot is None:  # nothing to show yet: this request waits for the first build
                self._key, self._snapshot = current_versions(self.storage), build_snapshot(self.storage)
                self._checked = time.monotonic()
            snapshot = self._snapshot
            if time.monotonic() - self._checked < self.ttl or self._refreshing:
                return snapshot
            self._checked, self._refreshing = time.monotonic(), True
        threading.Thread(target=self._refresh, name="explorer-snapshot", daemon=True).start()
        return snapshot

    def status(self) -> dict[str, object]:
        """For /healthz: whether a rebuild is running and why the last one failed, if it did."""
        with self._lock:
            return {"refreshing": self._refreshing, "refresh_error": self._error}

    def _refresh(self) -> None:
        try:
            key = current_versions(self.storage)  # read first: a table moving mid-build is caught next time
            if key != self._key:
                snapshot = build_snapshot(self.storage)
                with self._lock:
                    self._key, self._snapshot = key, snapshot
            self._error = None
        except Exception as exc:  # keep serving the old snapshot; the next check tries again
            log.exception("rebuilding the explorer's snapshot failed")  # the details: paths, store errors
            self._error = f"the last rebuild failed ({type(exc).__name__}); the details are in the explorer log"
        finally:
            with self._lock:
                self._refreshing = False


def rows_by_key(ds: LanceDataset | None, column: str, keys: list[str], columns: list[str],
                where: str | None = None) -> pa.Table:
    """Rows whose `column` is one of `keys` (a page's worth), in any order."""
    if ds is None or not keys:
        return pa.table({c: pa.array([], pa.string()) for c in columns})
    predicate = f"{column} IN ({', '.join(lance_io.sql_literal(k) for k in keys)})"
    return ds.to_table(columns=columns, filter=f"({predicate}) AND ({where})" if where else predicate)


def versions_filter(snapshot: Snapshot, embeddings: bool = False) -> str:
    """The Lance filter for rows of the captioner (and, with `embeddings`, embedder) version the snapshot chose."""
    where = f"captioner_version = {lance_io.sql_literal(snapshot.captioner_version or '')}"
    if embeddings and snapshot.embedder_version:
        where += f" AND embedder_version = {lance_io.sql_literal(snapshot.embedder_version)}"
    return where


def by_content(frame: pd.DataFrame, hits: pd.DataFrame, value: str) -> pd.Series:
    """sample_id -> `value` of `hits` keyed by content_id (every sample sharing a content gets it).

    Works on the categorical's integer codes: hashing a million content ids per query was the
    cost of a text search."""
    per_content = hits.drop_duplicates("content_id")
    column = frame["content_id"]
    positions = column.cat.categories.get_indexer(per_content["content_id"])
    found = positions >= 0
    by_code = np.full(len(column.cat.categories), np.nan)
    by_code[positions[found]] = per_content[value].to_numpy()[found]
    codes = column.cat.codes.to_numpy()
    rows = np.flatnonzero(np.isin(codes, positions[found]))
    return pd.Series(by_code[codes[rows]], index=frame["sample_id"].to_numpy()[rows], name=value)
