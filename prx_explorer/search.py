"""Explorer queries, each a bounded Lance query over the `explorer` table: a browse is a filtered
count and one page (offset, limit); a text search is Lance full-text search with the filter as a
prefilter (`fulltext`); "more like this" a vector search of an embedding table whose hits are
mapped to explorer rows by key. The menus' counts come from `facets`.

Request parameters only ever become Lance SQL literals (quoted by `sql_literal`, in `query`) or
dictionary keys: never paths, never markup.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field, replace

import numpy as np
import pyarrow as pa

from prx_explorer.facets import COUNTED, menus, present, query_menus, worst_captions
from prx_explorer.fulltext import text_hits
from prx_explorer.query import MAX_PAGE, Query, lance_filter
from prx_explorer.view import View, one_row, rows_by_key, versions_filter

PAGE_SIZE = 48
NEIGHBOURS = 200
# What a card, the API and the facet counts of a search read of a row: never the whole row.
PAGE_COLUMNS = ["sample_id", "source", "stored", "label", "tier", "bucket", "group_id", "keeper", "skip_reason",
                "reject_reason", "meta_label", "caption", "original_caption", "word_count", "captioner_id",
                "caption_verdict", "caption_problem"]
MATCH_COLUMNS = sorted({"sample_id", *COUNTED.values()})
# What a page says when a search fails: never the exception, which names paths inside the corpus.
SEARCH_FAILED = "The text search could not be run; the details are in the explorer log."
NO_SEARCH_TEXT = ("This corpus's `explorer` rows predate its search column: re-materialize `explorer` "
                  "(Dagster asset, per source) to search them.")
log = logging.getLogger(__name__)


@dataclass
class Results:
    query: Query
    total: int
    rows: list[dict]  # the page: explorer columns, captions "" where none, `score` in text and like modes
    facets: dict[str, list[tuple[str, int]]]
    mode: str  # browse | text | like | worst
    notes: list[str] = field(default_factory=list)
    menus_count: str = "matches"  # or "corpus" (a text search: its hits are ranked, not counted)

    @property
    def pages(self) -> int:
        return min(MAX_PAGE, max(1, math.ceil(self.total / PAGE_SIZE)))


def neighbours(view: View, sample_id: str, by: str) -> tuple[dict[str, float], str | None]:
    """sample_id -> cosine distance of the nearest samples to `sample_id` (nearest first), or a note why none."""
    row = one_row(view.table("explorer"), "sample_id", sample_id, present(view, ["content_id", "caption_key"]))
    if row is None:
        return {}, f"no sample {sample_id!r}"
    if by == "clip":
        table = view.table("source_embeddings")
        if table is None:
            return {}, "no source (CLIP) embeddings in this corpus"
        key, where = "sample_id", None
        own = rows_by_key(table, "sample_id", [sample_id], ["embedding"])
    else:
        table = view.table("caption_embeddings")
        if table is None or not view.captioner_version:
            return {}, "no caption embeddings in this corpus (materialize caption_embeddings)"
        key, where = "content_id", versions_filter(view, embeddings=True)
        mine = row.get("caption_key") or row["content_id"]  # a source caption's vectors are keyed by its caption key
        own = rows_by_key(table, "content_id", [mine] if mine else [], ["embedding"], where)
    if own.num_rows == 0:
        return {}, f"{sample_id} has no {by} embedding"
    vector = np.asarray(own["embedding"][0].as_py(), dtype=np.float32)
    # refine: IVF_PQ alone found 42% of the true top 50 at 1M rows, 99% re-ranked (docs/benchmarks.md)
    nearest = {"column": "embedding", "q": vector, "k": NEIGHBOURS + 1, "nprobes": 20, "refine_factor": 10,
               "metric": "cosine"}  # also without an index (below 256 rows), where Lance defaults to L2
    hits = table.to_table(nearest=nearest, filter=where, prefilter=where is not None, columns=[key, "_distance"])
    distance: dict[str, float] = {}
    for hit, value in zip(hits[key].to_pylist(), hits["_distance"].to_pylist()):
        value = max(0.0, value)  # float rounding gives an identical vector -1e-7, shown as "-0.000"
        distance[hit] = min(value, distance.get(hit, value))
    if key == "content_id":  # every sample of a content (or caption key) is as near as it is
        column = "caption_key" if row.get("caption_key") else "content_id"
        samples = rows_by_key(view.table("explorer"), column, list(distance), ["sample_id", column])
        distance = {s: distance[c] for s, c in zip(samples["sample_id"].to_pylist(), samples[column].to_pylist())}
    distance.pop(sample_id, None)
    return dict(sorted(distance.items(), key=lambda kv: (kv[1], kv[0]))), None


class NeighbourCache:
    """The nearest neighbours of the last `size` (sample, embedding) asks, keyed on every table
    version and the model versions the view chose: an ANN search per request is what a script
    looping over /api/neighbours would otherwise cost, and any new table version (a changed
    corpus) misses instead of answering from stale results."""

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self._items: OrderedDict[tuple, tuple[dict[str, float], str | None]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, view: View, sample_id: str, by: str) -> tuple[dict[str, float], str | None]:
        versions = (tuple(sorted(view.versions.items())), view.captioner_version, view.embedder_version)
        key = (versions, sample_id, by)
        with self._lock:
            if (found := self._items.get(key)) is not None:
                self._items.move_to_end(key)
                self.hits += 1
                return found
            self.misses += 1
        found = neighbours(view, sample_id, by)
        with self._lock:
            self._items = OrderedDict((k, v) for k, v in self._items.items() if k[0] == versions)
            self._items[key] = found
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        return found


@dataclass
class Matches:
    """A query's result before paging, what a page request reuses: a browse's filter and count,
    or a search's ranked sample ids (already filtered)."""

    where: str | None
    scores: dict[str, float] | None  # text and like modes: sample_id -> score, in rank order
    total: int
    facets: dict[str, list[tuple[str, int]]]
    mode: str
    notes: list[str]
    menus_count: str = "matches"  # "corpus": a text search's menus count the corpus (or its source)


def _ranked(view: View, scores: dict[str, float], where: str | None) -> tuple[dict[str, float], pa.Table]:
    """The ranked hits that `where` selects, and their rows' counted columns (an IN lookup)."""
    rows = rows_by_key(view.table("explorer"), "sample_id", list(scores), present(view, MATCH_COLUMNS), where)
    kept = set(rows["sample_id"].to_pylist())
    return {k: v for k, v in scores.items() if k in kept}, rows


def _text_scores(view: View, text: str, where: str | None) -> tuple[dict[str, float], list[str]]:
    """The text search's scores, or none and the page's note why."""
    if "search_text" not in view.table("explorer").schema.names:
        return {}, [NO_SEARCH_TEXT]
    try:
        return text_hits(view, text, where), []
    except Exception:  # a Lance failure: logged in full, a fixed note on the page
        log.exception("text search for %r failed", text)
        return {}, [SEARCH_FAILED]


def match(view: View, query: Query, nearest: NeighbourCache | None = None) -> Matches:
    if view.missing:
        return Matches(None, None, 0, menus({}), "browse", [view.missing])
    where, notes = lance_filter(view, query)
    if query.like:  # neighbours in another table: filtered here, by key
        scores, note = nearest.get(view, query.like, query.by) if nearest else neighbours(view, query.like, query.by)
        scores, rows = _ranked(view, scores, where)
        facets, more = query_menus(view, query, where, rows)
        return Matches(where, scores, len(scores), facets, "like", notes + ([note] if note else []) + more)
    if query.worst:  # the source's worst captions, kept by the `explorer` asset; filtered here, by key
        scores, rows = _ranked(view, worst_captions(view, query.worst, query.source), where)
        facets, more = query_menus(view, query, where, rows)
        return Matches(where, scores, len(scores), facets, "worst", notes + more)
    if query.q:  # the filter is the search's prefilter: every hit matches it
        scores, failed = _text_scores(view, query.q, where)
        notes = notes + failed
        facets, more = query_menus(view, query, where)
        return Matches(where, scores, len(scores), facets, "text", notes + more, menus_count="corpus")
    facets, more = query_menus(view, query, where)
    return Matches(where, None, view.table("explorer").count_rows(where), facets, "browse", notes + more)


class QueryCache:
    """The last `size` queries' matches per view, so paging (and the back button) costs one page
    read instead of the count, the search and the menus' counts again."""

    def __init__(self, size: int = 32, nearest: NeighbourCache | None = None) -> None:
        self.size, self.nearest = size, nearest
        self._items: OrderedDict[tuple[int, Query], Matches] = OrderedDict()
        self._lock = threading.Lock()

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def get(self, view: View, query: Query) -> Matches:
        key = (view.serial, replace(query, page=1))
        with self._lock:
            if (found := self._items.get(key)) is not None:
                self._items.move_to_end(key)
                return found
        found = match(view, query, self.nearest)
        with self._lock:
            self._items = OrderedDict((k, v) for k, v in self._items.items() if k[0] == view.serial)
            self._items[key] = found
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        return found


def page_rows(view: View, found: Matches, start: int) -> list[dict]:
    """The PAGE_SIZE rows of a result from `start`. A browse pages in the pinned version's table
    order (deterministic, and a page reads at most start + PAGE_SIZE matching rows): ordering by
    (source, sample_id) would sort every matching row on every request, as the table is written
    in ingest order, not sorted. A search's rows come in rank order."""
    explorer = view.table("explorer")
    if explorer is None or start >= found.total:
        return []
    columns = present(view, PAGE_COLUMNS)
    if found.scores is None:
        rows = explorer.to_table(columns=columns, filter=found.where, offset=start, limit=PAGE_SIZE,
                                 scan_in_order=True).to_pylist()
    else:
        ids = list(found.scores)[start:start + PAGE_SIZE]
        by_id = {r["sample_id"]: r for r in rows_by_key(explorer, "sample_id", ids, columns).to_pylist()}
        rows = [{**by_id[s], "score": found.scores[s]} for s in ids if s in by_id]
    return [{**r, "caption": r["caption"] or "", "original_caption": r["original_caption"] or ""} for r in rows]


def run_query(view: View, query: Query, cache: QueryCache | None = None) -> Results:
    found = cache.get(view, query) if cache is not None else match(view, query)
    rows = page_rows(view, found, (query.page - 1) * PAGE_SIZE)
    notes = list(found.notes)
    if found.total > MAX_PAGE * PAGE_SIZE:
        notes.append(f"{found.total:,} matches: the first {MAX_PAGE * PAGE_SIZE:,} are paged (a page's cost grows "
                     "with its depth); narrow the search with a filter to see the others")
    return Results(query, found.total, rows, found.facets, found.mode, notes, found.menus_count)
