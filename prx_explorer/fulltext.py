"""Full-text candidates: BM25 over the `explorer` table's `search_text` (the VLM caption and the
original caption, space-joined, under one INVERTED index: Lance holds each index's row lengths in
memory, ~1.2 GB per index at 100M rows, so one index, not one per caption), with the query's
filter applied before the ranking (a prefilter), so the best matches are of the filtered rows.

What a user types never reaches Lance's query-string parser: each search is one `MatchQuery`.
A quoted phrase ("red car") cannot be a Lance phrase query, which needs an INVERTED index built
with token positions, and the corpus's are not (positions make an index several times larger).
Instead a query holding a phrase asks for rows with every one of its words (AND), and keeps the
matched rows whose caption or original caption holds each phrase's words in order, adjacent,
compared as the highlighter compares them (lower case, crude stems). Without a phrase the words
are ORed. The filter runs over the best `TEXT_HITS` matches, read with their captions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lance.query import FullTextOperator, MatchQuery

from prx_explorer.render import stems
from prx_explorer.view import View

TEXT_HITS = 1000  # BM25's best are what anyone pages through (500 per caption column searched each on its own)
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


def text_hits(view: View, text: str, where: str | None = None) -> dict[str, float]:
    """sample_id -> BM25 score over both captions of the best matches of `text` among the rows `where`
    selects, best first (phrases checked on each caption)."""
    query = parse_text(text)
    explorer = view.table("explorer")
    if not query.words or explorer is None:
        return {}
    columns = ["sample_id", "_score"] + (["caption", "original_caption"] if query.phrases else [])
    hits = explorer.to_table(full_text_query=MatchQuery(query.words, "search_text", operator=query.operator),
                             columns=columns, limit=TEXT_HITS, filter=where, prefilter=where is not None).to_pylist()
    kept = (h for h in hits if not query.phrases or holds_phrases(h["caption"], query.phrases)
            or holds_phrases(h["original_caption"], query.phrases))
    return {h["sample_id"]: h["_score"] for h in sorted(kept, key=lambda h: -h["_score"])}
