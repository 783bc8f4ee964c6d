"""The filter menus' counts: from `explorer_facets` (a few hundred rows per source, summed when the
`explorer` asset wrote them) while the query narrows to a source at most, else counted over the
matching rows, the first FACET_SCAN of them, so a menu never costs a corpus-sized scan.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

import pyarrow as pa

from prx_core.stages.explorer.rows import META_KEY, REPETITION_SCALE, WORST, count_values
from prx_core.store import lance_io
from prx_explorer.query import COLUMN, FILTERS, Query
from prx_explorer.view import View

FACET_VALUES = 50  # options per filter menu; duplicate groups alone can number in the millions
FACET_SCAN = 20_000  # matching rows a filtered query's menus are counted over (~130 ms at 100M rows)
MENUS = (*FILTERS, "meta")  # the index page's filter menus; `meta` (key:value) offers the common metadata labels
# menu -> explorer column counted (the facets table names them the same way, `source` aside)
COUNTED = {**COLUMN, "meta": "meta_label"}
SPLIT = ("skipped",)  # a row's skip reasons are a comma-joined set: each reason counts


def capped_note(scanned: int) -> str:
    return f"Menu counts are counts of the first {scanned:,} matches."


def facet_rows(view: View, source: str = "") -> pa.Table:
    """The `explorer_facets` rows of one source, or of every source."""
    facets = view.table("explorer_facets")
    if facets is None:
        return pa.table({"source": [], "facet": [], "value": [], "count": []})
    return facets.to_table(filter=f"source = {lance_io.sql_literal(source)}" if source else None)


def table_counts(view: View, source: str = "") -> dict[str, Counter[str]]:
    """menu -> value -> rows, summed over the sources' facet rows (the source menu from their totals)."""
    counts: dict[str, Counter[str]] = {name: Counter() for name in MENUS}
    for row in facet_rows(view, source).to_pylist():
        if row["facet"] == "totals" and row["value"] == "rows":
            counts["source"][row["source"]] += row["count"]
        elif row["facet"] in ("label", "tier", "bucket", "group", "skipped", "rejected", "meta", "caption"):
            counts[row["facet"]][row["value"]] += row["count"]
    return counts


def row_counts(rows: pa.Table) -> dict[str, Counter[str]]:
    """menu -> value -> rows of `rows` (explorer columns; empty and null values left out; a column an
    older explorer table lacks counts nothing)."""
    return {name: count_values(rows[column], split=name in SPLIT) if column in rows.column_names else Counter()
            for name, column in COUNTED.items()}


def present(view: View, columns: Iterable[str]) -> list[str]:
    """Of `columns`, those the `explorer` table has (one written before a column existed lacks it)."""
    names = set(view.table("explorer").schema.names)
    return [c for c in columns if c in names]


def scanned_counts(view: View, where: str | None) -> tuple[dict[str, Counter[str]], str | None]:
    """Counts over the first FACET_SCAN rows matching `where`, and a note when there were more."""
    rows = view.table("explorer").to_table(columns=present(view, sorted(set(COUNTED.values()))), filter=where,
                                           limit=FACET_SCAN)
    return row_counts(rows), capped_note(FACET_SCAN) if rows.num_rows == FACET_SCAN else None


def menus(counts: Mapping[str, Counter[str]], top: int = FACET_VALUES) -> dict[str, list[tuple[str, int]]]:
    """Each menu's (value, count) options: the `top` most frequent (tiers: all, in order); the
    metadata menu's values as the `label:value` filters they select."""
    out: dict[str, list[tuple[str, int]]] = {}
    for name in MENUS:
        pairs = [(value, int(n)) for value, n in counts.get(name, Counter()).items() if n > 0]
        if name == "tier":
            out[name] = sorted(pairs, key=lambda kv: int(kv[0]))
            continue
        if name == "meta":
            pairs = [(f"{META_KEY}:{value}", n) for value, n in pairs]
        out[name] = sorted(pairs, key=lambda kv: (-kv[1], kv[0]))[:top]
    return out


def query_menus(view: View, query: Query, where: str | None,
                matched: pa.Table | None = None) -> tuple[dict[str, list[tuple[str, int]]], list[str]]:
    """The menus of a query: counts of `matched` (a similarity search's rows), else of the facets
    table while only a source is chosen or for a text search (reading every hit's columns would
    cost ~1 s at 100M rows: the hits are ranked, not counted), else of a capped scan of the
    filtered rows."""
    if matched is not None:
        return menus(row_counts(matched)), []
    if query.q and not query.like:
        return menus(table_counts(view, query.source)), []
    if query.only_source:
        return menus(table_counts(view, query.source)), []
    counts, note = scanned_counts(view, where)
    return menus(counts), [note] if note else []


def worst_captions(view: View, by: str, source: str = "") -> dict[str, float]:
    """sample_id -> measure of the worst captions by `by` (Query.WORST), worst first: the lists the
    `explorer` asset kept per source in `explorer_facets` (a few hundred rows, never a scan of the
    corpus), merged over the sources. Words for shortest and longest, a 0..1 score for repetitive,
    generations for retried."""
    facets = view.table("explorer_facets")
    if facets is None:
        return {}
    where = f"facet = {lance_io.sql_literal(WORST[by])}"
    if source:
        where += f" AND source = {lance_io.sql_literal(source)}"
    rows = facets.to_table(columns=["value", "count"], filter=where).to_pylist()
    order = sorted(rows, key=lambda r: (r["count"] if by == "shortest" else -r["count"], r["value"]))
    scale = REPETITION_SCALE if by == "repetitive" else 1
    return {r["value"]: r["count"] / scale for r in order}


def totals(view: View) -> list[dict[str, int | str]]:
    """Per source, the overview's totals (rows, rejected, bucketed, in MDS, skipped, duplicates, ...)."""
    per: dict[str, dict[str, int | str]] = {}
    for row in facet_rows(view).to_pylist():
        if row["facet"] == "totals":
            per.setdefault(row["source"], {"source": row["source"]})[row["value"]] = row["count"]
    return [per[s] for s in sorted(per)]


def by_source(rows: Iterable[dict], facet: str) -> dict[str, dict[str, int]]:
    """source -> value -> count of one facet of `explorer_facets` rows: what a plot stacks."""
    out: dict[str, dict[str, int]] = {}
    for row in rows:
        if row["facet"] == facet:
            out.setdefault(row["source"], {})[row["value"]] = row["count"]
    return out
