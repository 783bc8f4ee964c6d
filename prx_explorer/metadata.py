"""Per-sample source metadata (`samples.metadata`, a string map: label, license, width, ...) and
`source_url` in the explorer.

Both are untrusted source text: pages escape them like captions, and a URL becomes a link only
when it is plain http(s) (rel="noopener noreferrer nofollow"), else it is shown as text. The
`explorer` table holds one bounded column of them, `meta_label` (the `label` key: class folders,
`.cls` members), for facet counts and the `label` filter; a filter on another key asks the pinned
`samples` dataset (`query.meta_filter`), so any key filters without the maps in memory. A table
written before these columns existed simply has none: no facet, no match.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

from lance import LanceDataset

from prx_explorer.params import MAX_META_KEY, MAX_META_VALUE
from prx_explorer.view import View, one_row

MAX_SHOWN = 100  # metadata entries on a detail page
MAX_SHOWN_CHARS = 2000  # of one value (or URL) on a detail page
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def has_metadata(ds: LanceDataset | None) -> bool:
    return ds is not None and "metadata" in ds.schema.names


def split_filter(value: str) -> tuple[str, str]:
    """`key:value` (validated by `params.meta_param`) as its key and value."""
    key, _, wanted = value.partition(":")
    return key, wanted


def filter_link(key: str, value: str) -> str | None:
    """The `meta` filter value selecting samples with this entry, where the filter accepts it."""
    if not key or ":" in key or len(key) > MAX_META_KEY or len(value) > MAX_META_VALUE:
        return None
    if _CONTROL.search(key + value) or key != key.strip() or value != value.strip():
        return None
    return f"{key}:{value}"


def safe_link(url: str | None) -> str | None:
    """`url` when a browser may follow it: http(s) with a host, nothing odd in it; else None."""
    if not url or len(url) > MAX_SHOWN_CHARS or _CONTROL.search(url) or any(c.isspace() for c in url):
        return None
    try:
        parts = urlsplit(url)
    except ValueError:
        return None
    return url if parts.scheme in ("http", "https") and parts.hostname else None


def _shown(text: str) -> str:
    return text if len(text) <= MAX_SHOWN_CHARS else text[:MAX_SHOWN_CHARS] + "…"


def sample_details(view: View, sample_id: str) -> dict[str, Any]:
    """The detail page's metadata entries (key, value, filter value or None; at most MAX_SHOWN,
    values cut for display), how many more there are, and the source URL with its link, if any."""
    samples = view.table("samples")
    out: dict[str, Any] = {"entries": [], "more": 0, "source_url": None, "source_link": None}
    columns = [c for c in ("metadata", "source_url") if samples is not None and c in samples.schema.names]
    row = one_row(samples, "sample_id", sample_id, columns) if columns else None  # a BTREE lookup, not a scan
    if row is None:
        return out
    pairs = [(str(k), "" if v is None else str(v)) for k, v in (row.get("metadata") or [])]
    out["entries"] = [(_shown(k), _shown(v), filter_link(k, v)) for k, v in sorted(pairs)[:MAX_SHOWN]]
    out["more"] = max(0, len(pairs) - MAX_SHOWN)
    if url := row.get("source_url"):
        out["source_url"], out["source_link"] = _shown(url), safe_link(url)
    return out
