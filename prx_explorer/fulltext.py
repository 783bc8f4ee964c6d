"""Full-text candidates: BM25 over the `explorer` table's VLM caption and original caption, in Lance,
with the query's filter applied before the ranking (a prefilter), so the best matches are of the
filtered rows.

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

from lance import LanceDataset
from lance.query import FullTextOperator, MatchQuery

from prx_explorer.render import stems
from prx_explorer.view import View

TEXT_HITS = 500  # per caption column: BM25's best are what anyone pages through (~35 ms each at 100M rows)
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


def _search(ds: LanceDataset, column: str, query: TextQuery, where: str | None) -> dict[str, float]:
    """sample_id -> `_score` of the best matches of `query` on `column` among the rows `where`
    selects (phrases checked on the text)."""
    columns = ["sample_id", "_score"] + ([column] if query.phrases else [])
    hits = ds.to_table(full_text_query=MatchQuery(query.words, column, operator=query.operator), columns=columns,
                       limit=TEXT_HITS, filter=where, prefilter=where is not None).to_pylist()
    return {h["sample_id"]: h["_score"] for h in hits if not query.phrases or holds_phrases(h[column], query.phrases)}


def text_hits(view: View, text: str, where: str | None = None) -> dict[str, float]:
    """sample_id -> best BM25 score over the VLM caption and the original caption, best first."""
    query = parse_text(text)
    explorer = view.table("explorer")
    if not query.words or explorer is None:
        return {}
    best: dict[str, float] = {}
    for column in ("caption", "original_caption"):
        for sample_id, score in _search(explorer, column, query, where).items():
            best[sample_id] = max(score, best.get(sample_id, score))
    return dict(sorted(best.items(), key=lambda kv: -kv[1]))
