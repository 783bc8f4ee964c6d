"""Full-text candidates: BM25 over the VLM captions and the original captions, in Lance.

What a user types never reaches Lance's query-string parser: each search is a `MatchQuery` on
one column. A quoted phrase ("red car") cannot be a Lance phrase query, which needs an INVERTED
index built with token positions, and the corpus's are not (positions make an index several
times larger, and every existing corpus would need its indexes rebuilt). Instead a query holding
a phrase asks for rows with every one of its words (AND), and keeps the matched rows whose
caption or original caption holds each phrase's words in order, adjacent, compared as the
highlighter compares them (lower case, crude stems). Without a phrase the words are ORed, as
before. The filter runs over the best `TEXT_HITS` AND matches per column, read with their text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pandas as pd
from lance import LanceDataset
from lance.query import FullTextOperator, MatchQuery

from prx_explorer.render import stems
from prx_explorer.snapshot import Snapshot, by_content, versions_filter

TEXT_HITS = 2000  # per caption column: BM25's best are what anyone pages through
_QUOTED = re.compile(r'"([^"]*)"')


@dataclass(frozen=True)
class TextQuery:
    """A search box's text: its words (quotes removed) and each quoted phrase of two or more words, as stems."""

    words: str
    phrases: tuple[tuple[str, ...], ...]

    @property
    def operator(self) -> FullTextOperator:
        return FullTextOperator.AND if self.phrases else FullTextOperator.OR


def parse_text(text: str) -> TextQuery:
    """Quoted phrases out of `text`; an unbalanced quote is just removed, a one-word phrase is a word."""
    phrases = tuple(p for p in (tuple(stems(m)) for m in _QUOTED.findall(text)) if len(p) > 1)
    return TextQuery(text.replace('"', " ").strip(), phrases)


def holds_phrases(text: str | None, phrases: tuple[tuple[str, ...], ...]) -> bool:
    """Whether every phrase occurs in `text` as consecutive words."""
    words = tuple(stems(text or ""))
    return all(any(words[i:i + len(p)] == p for i in range(len(words) - len(p) + 1)) for p in phrases)


def _search(ds: LanceDataset, column: str, key: str, query: TextQuery, where: str | None = None) -> pd.DataFrame:
    """`key` and `_score` of the best matches of `query` on `column` (phrases checked on its text)."""
    columns = [key, "_score"] + ([column] if query.phrases else [])
    hits = ds.to_table(full_text_query=MatchQuery(query.words, column, operator=query.operator), columns=columns,
                       limit=TEXT_HITS, filter=where).to_pandas()
    if query.phrases:
        hits = hits.loc[hits[column].map(lambda t: holds_phrases(t, query.phrases)).astype(bool)]
    return hits[[key, "_score"]]


def text_hits(snapshot: Snapshot, text: str) -> pd.Series:
    """sample_id -> best BM25 score over the VLM caption and the original caption."""
    query = parse_text(text)
    if not query.words:
        return pd.Series(dtype="float64")
    scores: list[pd.Series] = []
    captions = snapshot.table("captions")
    if captions is not None and snapshot.captioner_version:
        hits = _search(captions, "caption", "content_id", query, versions_filter(snapshot))
        scores.append(by_content(snapshot.frame, hits, "_score"))
    samples = snapshot.table("samples")
    if samples is not None:
        scores.append(_search(samples, "original_caption", "sample_id", query).set_index("sample_id")["_score"])
    scores = [s for s in scores if len(s)]
    if not scores:
        return pd.Series(dtype="float64")
    combined = pd.concat(scores)
    return combined.groupby(level=0).max().sort_values(ascending=False, kind="stable")
