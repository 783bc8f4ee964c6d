"""Explorer queries: full-text and nearest-neighbour candidates from Lance, filters and facets
over the snapshot frame, one page of captions read back.

Request parameters only ever become Lance SQL literals (quoted by `sql_literal`), pandas masks
or dictionary keys: never paths, never markup.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from urllib.parse import urlencode

import numpy as np
import pandas as pd

from prx_core import lance_io
from prx_explorer.snapshot import Snapshot, rows_by_key

PAGE_SIZE = 48
TEXT_HITS = 2000  # per caption column: BM25's best are what anyone pages through
NEIGHBOURS = 200
MAX_PARAM = 500
FILTERS = ("source", "label", "tier", "bucket", "group", "skipped", "rejected")
FRAME_COLUMN = {"source": "source", "label": "label", "tier": "tier", "bucket": "bucket", "group": "group_id",
                "skipped": "skip_reason", "rejected": "reject_reason"}


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
    page: int = 1

    @classmethod
    def from_params(cls, params: Mapping[str, str]) -> Query:
        values = {f.name: str(params.get(f.name, "")).strip()[:MAX_PARAM] for f in fields(cls) if f.name != "page"}
        values["by"] = values["by"] if values["by"] in ("caption", "clip") else "caption"
        page = str(params.get("page", "1"))
        return cls(**values, page=max(1, min(int(page), 1_000_000)) if page.isdigit() else 1)

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


def _versions_filter(snapshot: Snapshot, embeddings: bool = False) -> str:
    where = f"captioner_version = {lance_io.sql_literal(snapshot.captioner_version or '')}"
    if embeddings and snapshot.embedder_version:
        where += f" AND embedder_version = {lance_io.sql_literal(snapshot.embedder_version)}"
    return where


def by_content(frame: pd.DataFrame, hits: pd.DataFrame, value: str) -> pd.Series:
    """sample_id -> `value` of `hits` keyed by content_id (every sample sharing a content gets it)."""
    per_content = hits.drop_duplicates("content_id").set_index("content_id")[value]
    samples = frame.loc[frame["content_id"].isin(per_content.index), ["sample_id", "content_id"]]
    return pd.Series(samples["content_id"].map(per_content).to_numpy(), index=samples["sample_id"].to_numpy(),
                     name=value)


def text_hits(snapshot: Snapshot, text: str) -> pd.Series:
    """sample_id -> best BM25 score over the VLM caption and the original caption."""
    scores: list[pd.Series] = []
    captions = snapshot.table("captions")
    if captions is not None and snapshot.captioner_version:
        hits = captions.to_table(full_text_query=text, columns=["content_id", "_score"], limit=TEXT_HITS,
                                 filter=_versions_filter(snapshot)).to_pandas()
        scores.append(by_content(snapshot.frame, hits, "_score"))
    samples = snapshot.table("samples")
    if samples is not None:
        hits = samples.to_table(full_text_query=text, columns=["sample_id", "_score"], limit=TEXT_HITS).to_pandas()
        scores.append(hits.set_index("sample_id")["_score"])
    if not scores:
        return pd.Series(dtype="float64")
    combined = pd.concat(scores)
    return combined.groupby(level=0).max().sort_values(ascending=False, kind="stable")


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
        own = rows_by_key(table, "sample_id", [sample_id], ["embedding"])
    else:
        table = snapshot.table("caption_embeddings")
        if table is None or not snapshot.captioner_version:
            return pd.Series(dtype="float64"), "no caption embeddings in this corpus (materialize caption_embeddings)"
        key, where = "content_id", _versions_filter(snapshot, embeddings=True)
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


def _mask(frame: pd.DataFrame, name: str, value: str) -> pd.Series:
    column = frame[FRAME_COLUMN[name]]
    if name in ("skipped", "rejected"):
        if value == "no":
            return column.isna()
        if value == "yes":
            return column.notna()
        return column.fillna("").str.split(",").apply(lambda reasons: value in reasons)
    if name == "tier":
        return pd.to_numeric(column, errors="coerce") == (int(value) if value.isdigit() else -1)
    return column.astype("string") == value


def facet_counts(frame: pd.DataFrame) -> dict[str, list[tuple[str, int]]]:
    out: dict[str, list[tuple[str, int]]] = {}
    for name in FILTERS:
        column = frame[FRAME_COLUMN[name]].dropna()
        if name in ("skipped", "rejected"):
            column = column.str.split(",").explode()
        if name == "tier":
            column = column.astype("int64").astype("string")
        counts = column.astype("string").value_counts()
        out[name] = sorted(((str(k), int(v)) for k, v in counts.items()),
                           key=lambda kv: (int(kv[0]) if name == "tier" else 0, -kv[1] if name != "tier" else 0, kv[0]))
    return out


def run_query(snapshot: Snapshot, query: Query) -> Results:
    frame, notes, mode = snapshot.frame, [], "browse"
    scores: pd.Series | None = None
    if query.like:
        scores, note = neighbours(snapshot, query.like, query.by)
        notes += [note] if note else []
        mode = "like"
    elif query.q:
        try:
            scores = text_hits(snapshot, query.q)
        except (ValueError, OSError) as exc:  # Lance rejects some query syntax
            scores, notes = pd.Series(dtype="float64"), [f"search failed: {str(exc).splitlines()[0][:200]}"]
        mode = "text"
    if scores is not None:
        scores = scores[frame.index.get_indexer(scores.index) >= 0]
        frame = frame.loc[scores.index].assign(score=scores.to_numpy())
    for name in FILTERS:
        if value := getattr(query, name):
            frame = frame[_mask(frame, name, value)]
    start = (query.page - 1) * PAGE_SIZE
    page = frame.iloc[start:start + PAGE_SIZE].copy()
    return Results(query, len(frame), with_captions(snapshot, page), facet_counts(frame), mode, notes)


def with_captions(snapshot: Snapshot, page: pd.DataFrame) -> pd.DataFrame:
    """The page's VLM captions (chosen captioner version) and original captions, read for it only."""
    page = page.copy()
    page["caption"], page["original_caption"] = "", ""
    captions = snapshot.table("captions")
    if len(page) and captions is not None and snapshot.captioner_version:
        ids = sorted(set(page["content_id"].dropna()))
        table = rows_by_key(captions, "content_id", ids, ["content_id", "caption"], _versions_filter(snapshot))
        text = dict(zip(table["content_id"].to_pylist(), table["caption"].to_pylist()))
        page["caption"] = [text.get(c, "") for c in page["content_id"]]
    samples = snapshot.table("samples")
    addresses = page["rowaddr"].dropna().astype("int64") if "rowaddr" in page else pd.Series(dtype="int64")
    if len(addresses) and samples is not None:
        table = samples._take_rows(addresses.tolist(), columns=["original_caption"])
        originals = pd.Series(table["original_caption"].to_pylist(), index=addresses.index)
        page.loc[addresses.index, "original_caption"] = originals.fillna("")
    return page
