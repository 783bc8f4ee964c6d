"""Explorer queries: full-text (`fulltext`) and nearest-neighbour candidates from Lance, filters and facets
over the snapshot frame, one page of captions read back.

Request parameters only ever become Lance SQL literals (quoted by `sql_literal`), pandas masks
or dictionary keys: never paths, never markup.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from urllib.parse import urlencode

import numpy as np
import pandas as pd
from lance import LanceDataset

from prx_explorer import metadata
from prx_explorer.fulltext import text_hits
from prx_explorer.params import choice_param, int_param, meta_param, text_param
from prx_explorer.snapshot import Snapshot, by_content, rows_by_key, versions_filter

PAGE_SIZE = 48
NEIGHBOURS = 200
MAX_PAGE = 1_000_000
MAX_TIER = 1 << 16
BY = ("caption", "clip")
FACET_VALUES = 50  # options per filter menu; duplicate groups alone can number in the millions
FILTERS = ("source", "label", "tier", "bucket", "group", "skipped", "rejected")
FRAME_COLUMN = {"source": "source", "label": "label", "tier": "tier", "bucket": "bucket", "group": "group_id",
                "skipped": "skip_reason", "rejected": "reject_reason"}
MENUS = (*FILTERS, "meta")  # the index page's filter menus; `meta` (key:value) offers the common metadata labels
# What a page says when a search fails: never the exception, which names paths inside the corpus.
SEARCH_FAILED = "The text search could not be run; the details are in the explorer log."
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Query:
    """A search as it appears in the URL. `skipped` / `rejected`: "" any, "no", "yes" or a reason."""

    q: str = ""
    like: str = ""  # a sample_id: "more like this"
    by: str = "caption"  # caption | clip
    source: str = ""
    label: str = ""
    tier: str = ""
    bucket: str = ""
    group: str = ""
    skipped: str = ""
    rejected: str = ""
    meta: str = ""  # key:value of the samples' source metadata, e.g. label:cat
    page: int = 1

    @classmethod
    def from_params(cls, params: Mapping[str, str]) -> Query:
        """The query of a request; a malformed value raises `BadRequest` (a 400)."""
        checked = ("by", "tier", "page", "meta")
        values = {f.name: text_param(params, f.name) for f in fields(cls) if f.name not in checked}
        tier = int_param(params, "tier", None, 1, MAX_TIER)
        return cls(**values, by=choice_param(params, "by", BY, "caption"), tier="" if tier is None else str(tier),
                   meta=meta_param(params, "meta"), page=int_param(params, "page", 1, 1, MAX_PAGE) or 1)

    def url(self, **changes: object) -> str:
        """This query with `changes`, as a `?...` string (page resets unless given)."""
        values = asdict(replace(self, **{"page": 1, **changes}))
        kept = {k: v for k, v in values.items() if v not in ("", None) and not (k == "page" and v == 1)
                and not (k == "by" and v == "caption")}
        return "?" + urlencode(kept) if kept else "?"


@dataclass
class Results:
    query: Query
    total: int
    rows: pd.DataFrame  # the page, with `caption`, `original_caption` and `score` columns
    facets: dict[str, list[tuple[str, int]]]
    mode: str  # browse | text | like
    notes: list[str] = field(default_factory=list)

    @property
    def pages(self) -> int:
        return max(1, math.ceil(self.total / PAGE_SIZE))


def neighbours(snapshot: Snapshot, sample_id: str, by: str) -> tuple[pd.Series, str | None]:
    """sample_id -> cosine distance of the nearest samples to `sample_id`, or a note why none."""
    frame = snapshot.frame
    if sample_id not in frame.index:
        return pd.Series(dtype="float64"), f"no sample {sample_id!r}"
    if by == "clip":
        table = snapshot.table("source_embeddings")
        if table is None:
            return pd.Series(dtype="float64"), "no source (CLIP) embeddings in this corpus"
        key, where = "sample_id", None
        address = frame.at[sample_id, "clip_rowaddr"]  # recorded by the snapshot: a take, not a scan
        own = table._take_rows([int(address)], columns=["embedding"]) if pd.notna(address) else table.schema.empty_table()
    else:
        table = snapshot.table("caption_embeddings")
        if table is None or not snapshot.captioner_version:
            return pd.Series(dtype="float64"), "no caption embeddings in this corpus (materialize caption_embeddings)"
        key, where = "content_id", versions_filter(snapshot, embeddings=True)
        own = rows_by_key(table, "content_id", [str(frame.at[sample_id, "content_id"])], ["embedding"], where)
    if own.num_rows == 0:
        return pd.Series(dtype="float64"), f"{sample_id} has no {by} embedding"
    vector = np.asarray(own["embedding"][0].as_py(), dtype=np.float32)
    # refine: IVF_PQ alone found 42% of the true top 50 at 1M rows, 99% re-ranked (docs/benchmarks.md)
    nearest = {"column": "embedding", "q": vector, "k": NEIGHBOURS + 1, "nprobes": 20, "refine_factor": 10,
               "metric": "cosine"}  # also without an index (below 256 rows), where Lance defaults to L2
    hits = table.to_table(nearest=nearest, filter=where,
                          prefilter=where is not None, columns=[key, "_distance"]).to_pandas()
    distances = (by_content(frame, hits, "_distance") if key == "content_id"
                 else hits.set_index("sample_id")["_distance"]).drop(sample_id, errors="ignore")
    return distances.groupby(level=0).min().sort_values(kind="stable"), None


class NeighbourCache:
    """The nearest neighbours of the last `size` (sample, embedding) asks, keyed on every table
    version and the model versions the snapshot chose: an ANN search per request is what a
    script looping over /api/neighbours would otherwise cost, and any new table version (a
    changed corpus) misses instead of answering from stale results."""

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self._items: OrderedDict[tuple, tuple[pd.Series, str | None]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, snapshot: Snapshot, sample_id: str, by: str) -> tuple[pd.Series, str | None]:
        versions = (tuple(sorted(snapshot.versions.items())), snapshot.captioner_version, snapshot.embedder_version)
        key = (versions, sample_id, by)
        with self._lock:
            if (found := self._items.get(key)) is not None:
                self._items.move_to_end(key)
                self.hits += 1
                return found
            self.misses += 1
        found = neighbours(snapshot, sample_id, by)
        with self._lock:
            self._items = OrderedDict((k, v) for k, v in self._items.items() if k[0] == versions)
            self._items[key] = found
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        return found


def _mask(frame: pd.DataFrame, name: str, value: str) -> pd.Series:
    column = frame[FRAME_COLUMN[name]]
    if name in ("skipped", "rejected"):
        if value in ("no", "yes"):
            return column.isna() if value == "no" else column.notna()
        categories = column.cat.categories  # comma-joined reason sets: few, so test each set once
        return column.isin([c for c in categories if value in str(c).split(",")])
    if name == "tier":
        return column == (int(value) if value.isascii() and value.isdigit() and len(value) < 10 else -1)
    return column == value


def facet_counts(frame: pd.DataFrame, top: int = FACET_VALUES) -> dict[str, list[tuple[str, int]]]:
    """value -> count per filter over `frame` (the most frequent `top`; tiers in order)."""
    out: dict[str, list[tuple[str, int]]] = {}
    for name in FILTERS:
        counts = frame[FRAME_COLUMN[name]].value_counts()
        counts = counts[counts > 0]
        if name in ("skipped", "rejected"):  # a sample skipped for two reasons counts under both
            totals: Counter[str] = Counter()
            for reasons, count in counts.items():
                for reason in str(reasons).split(","):
                    totals[reason] += int(count)
            counts = pd.Series(totals, dtype="int64")
        pairs = [(str(int(k)) if name == "tier" else str(k), int(v)) for k, v in counts.items()]
        pairs.sort(key=lambda kv: (int(kv[0]), 0) if name == "tier" else (-kv[1], kv[0]))
        out[name] = pairs if name == "tier" else pairs[:top]
    labels = frame["meta_label"].value_counts() if "meta_label" in frame else pd.Series(dtype="int64")
    pairs = [(f"{metadata.FACET_KEY}:{k}", int(v)) for k, v in labels[labels > 0].items()]
    out["meta"] = sorted(pairs, key=lambda kv: (-kv[1], kv[0]))[:top]
    return out


@dataclass
class Matches:
    """A query's whole result (before paging): what a page request reuses."""

    frame: pd.DataFrame
    facets: dict[str, list[tuple[str, int]]]
    mode: str
    notes: list[str]


def match(snapshot: Snapshot, query: Query, nearest: NeighbourCache | None = None) -> Matches:
    frame, notes, mode = snapshot.frame, [], "browse"
    scores: pd.Series | None = None
    if query.like:
        scores, note = nearest.get(snapshot, query.like, query.by) if nearest else neighbours(snapshot, query.like, query.by)
        notes += [note] if note else []
        mode = "like"
    elif query.q:
        try:
            scores = text_hits(snapshot, query.q)
        except Exception:  # a Lance failure: logged in full, a fixed note on the page
            log.exception("text search for %r failed", query.q)
            scores, notes = pd.Series(dtype="float64"), [SEARCH_FAILED]
        mode = "text"
    if scores is not None:
        scores = scores[frame.index.get_indexer(scores.index) >= 0]
        frame = frame.loc[scores.index].assign(score=scores.to_numpy())
    for name in FILTERS:
        if value := getattr(query, name):
            frame = frame[_mask(frame, name, value)]
    if query.meta:
        ids, note = metadata.matching_ids(snapshot, query.meta)
        frame, notes = frame[frame.index.isin(ids)], notes + ([note] if note else [])
    return Matches(frame, facet_counts(frame), mode, notes)


class QueryCache:
    """The last `size` queries' matches per snapshot, so paging (and the back button) costs one
    page read instead of the filters and facet counts again (600 ms at 1M rows)."""

    def __init__(self, size: int = 32, nearest: NeighbourCache | None = None) -> None:
        self.size, self.nearest = size, nearest
        self._items: OrderedDict[tuple[int, Query], Matches] = OrderedDict()
        self._lock = threading.Lock()

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def get(self, snapshot: Snapshot, query: Query) -> Matches:
        key = (snapshot.serial, replace(query, page=1))
        with self._lock:
            if (found := self._items.get(key)) is not None:
                self._items.move_to_end(key)
                return found
        found = match(snapshot, query, self.nearest)
        with self._lock:
            self._items = OrderedDict((k, v) for k, v in self._items.items() if k[0] == snapshot.serial)
            self._items[key] = found
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        return found


def run_query(snapshot: Snapshot, query: Query, cache: QueryCache | None = None) -> Results:
    found = cache.get(snapshot, query) if cache is not None else match(snapshot, query)
    start = (query.page - 1) * PAGE_SIZE
    page = found.frame.iloc[start:start + PAGE_SIZE]
    return Results(query, len(found.frame), with_captions(snapshot, page), found.facets, found.mode, list(found.notes))


def _take_text(table: LanceDataset | None, page: pd.DataFrame, address: str, column: str) -> pd.Series:
    """`column` of the page's rows by their row address in `table` ("" where a row has none):
    a take of a page, where a filter on a key would scan the key column of the whole table."""
    out = pd.Series([""] * len(page), index=page.index, dtype=object)
    addresses = page[address].dropna().astype("int64") if address in page else pd.Series(dtype="int64")
    if len(addresses) and table is not None:
        values = table._take_rows(addresses.tolist(), columns=[column])[column].to_pylist()
        out[addresses.index] = [v or "" for v in values]
    return out


def with_captions(snapshot: Snapshot, page: pd.DataFrame) -> pd.DataFrame:
    """The page's VLM captions (chosen captioner version) and original captions, read for it only."""
    page = page.copy()
    page["caption"] = _take_text(snapshot.table("captions"), page, "caption_rowaddr", "caption")
    page["original_caption"] = _take_text(snapshot.table("samples"), page, "rowaddr", "original_caption")
    return page
