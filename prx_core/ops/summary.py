"""Per-source counts read from the corpus tables themselves (not from run logs), so the
summary is true whatever was rebuilt and however. What `prx-corpus build` prints at its end: an
operator's view across every table, hence here, above the shards and sources it reads."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from prx_core.models.caption_keys import source_caption_key
from prx_core.shards.skiplists.files import read_skip_lists
from prx_core.sources.records import TAKEN_DOWN
from prx_core.store import lance_io
from prx_core.store.storage import Storage

COLUMNS = ["source", "samples", "rejects", "bucketed", "text", "nsfw", "duplicates", "streams", "in_mds", "skipped"]


def _by_source(store: Storage, table: str, columns: list[str], where: str | None = None) -> list[dict[str, Any]]:
    uri = store.lance_uri(table)
    if not lance_io.table_exists(uri, store.lance_storage_options()):
        return []
    return lance_io.read_table(uri, columns, where, store.lance_storage_options()).to_pylist()


def corpus_summary(store: Storage) -> list[dict[str, Any]]:
    """One row per source plus a `total` row, in the order of `COLUMNS`."""
    rows: dict[str, Counter[str]] = defaultdict(Counter)
    for r in _by_source(store, "samples", ["source"]):
        rows[r["source"]]["samples"] += 1
    for r in _by_source(store, "rejects", ["source", "reason"]):
        rows[r["source"]]["rejects"] += 1
        rows[r["source"]]["taken_down"] += r["reason"] == TAKEN_DOWN
    for r in _by_source(store, "buckets", ["source"], "tier IS NOT NULL"):
        rows[r["source"]]["bucketed"] += 1
    for r in _by_source(store, "duplicates", ["source"], "NOT keeper"):
        rows[r["source"]]["duplicates"] += 1
    labels = {r["content_id"]: r["label"] for r in _by_source(store, "caption_labels", ["content_id", "label"])}
    # a model caption's labels are keyed by content, a source caption's by (content, its own text)
    own = {r["sample_id"]: source_caption_key(r["content_id"], r["original_caption"])
           for r in _by_source(store, "samples", ["sample_id", "content_id", "original_caption"])} if labels else {}
    streams: dict[str, set[str]] = defaultdict(set)
    for r in _by_source(store, "mds_index", ["source", "tier", "bucket", "content_id", "sample_id"]):
        rows[r["source"]]["in_mds"] += 1
        streams[r["source"]].add(f"{r['tier']}/{r['bucket']}")
        label = labels.get(r["content_id"]) or labels.get(own.get(r["sample_id"], ""))
        if label in ("text", "nsfw"):
            rows[r["source"]][label] += 1
    for source, names in streams.items():
        rows[source]["streams"] = len(names)
    skipped: dict[str, set[tuple[str, int]]] = defaultdict(set)
    for skip in read_skip_lists(store.root, None, store.storage_options):
        skipped[skip.source].update((skip.stream, i) for i in skip.indices)
    table = []
    for source in sorted(rows):
        counts = rows[source]
        table.append({"source": source, **{c: counts.get(c, 0) for c in COLUMNS[1:-1]}, "skipped": len(skipped[source]),
                      "taken_down": counts.get("taken_down", 0)})
    total = {"source": "total", **{c: sum(r[c] for r in table) for c in COLUMNS[1:]}}
    return table + [total]


def format_summary(table: list[dict[str, Any]]) -> str:
    widths = {c: max(len(c), *(len(str(r[c])) for r in table)) for c in COLUMNS}
    lines = ["  ".join(c.rjust(widths[c]) if c != "source" else c.ljust(widths[c]) for c in COLUMNS)]
    for r in table:
        lines.append("  ".join(str(r[c]).rjust(widths[c]) if c != "source" else str(r[c]).ljust(widths[c]) for c in COLUMNS))
    taken = {r["source"]: r["taken_down"] for r in table if r.get("taken_down") and r["source"] != "total"}
    if taken:  # rows a recorded takedown kept out at ingest (among the rejects above)
        lines.append(f"taken down, refused at ingest: {sum(taken.values())} "
                     f"({', '.join(f'{s} {n}' for s, n in taken.items())})")
    return "\n".join(lines)
