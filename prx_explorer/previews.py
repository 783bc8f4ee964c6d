"""The Previews page: what `prx-corpus preview` saw, before any backfill (prx_core.stages.preview).

Reads the root's `caption_previews` table (a few rows per preview run: small, read whole): the
latest run per source, or one source's runs, newest first. Each image shows its thumbnail (a
JPEG the preview made itself), the caption and what produced it, the checks' verdict, the tokens
and the label with its score; each run its summary: time and tokens per image, verdict counts and
the projected GPU-hours of the whole source.
"""

from __future__ import annotations

import json
from typing import Any

from prx_core.stages.preview import TABLE
from prx_core.store import lance_io
from prx_core.store.storage import Storage

MAX_RUNS = 20  # runs shown for one source


def preview_runs(storage: Storage, source: str | None) -> list[dict[str, Any]]:
    """Preview runs, newest first: each with its summary and its images in order (no thumbnails)."""
    uri = storage.lance_uri(TABLE)
    if not lance_io.table_exists(uri, storage.lance_storage_options()):
        return []
    where = f"source = {lance_io.sql_literal(source)}" if source else None
    columns = [c for c in lance_io.require_table(uri, storage.lance_storage_options()).schema.names if c != "thumbnail"]
    rows = lance_io.read_table(uri, columns, where, storage.lance_storage_options()).to_pylist()
    runs: dict[str, dict[str, Any]] = {}
    for row in rows:
        run = runs.setdefault(row["preview_id"], {"preview_id": row["preview_id"], "created": row["created"],
                                                  "source": row["source"], "summary": json.loads(row["summary"]),
                                                  "images": []})
        run["images"].append(row)
    ordered = sorted(runs.values(), key=lambda r: -r["created"])
    for run in ordered:
        run["images"].sort(key=lambda r: r["position"])
    if source:
        return ordered[:MAX_RUNS]
    latest: dict[str, dict[str, Any]] = {}
    for run in ordered:
        latest.setdefault(run["source"], run)
    return sorted(latest.values(), key=lambda r: r["source"])


def preview_thumbnail(storage: Storage, preview_id: str, position: int) -> bytes | None:
    uri = storage.lance_uri(TABLE)
    if not lance_io.table_exists(uri, storage.lance_storage_options()):
        return None
    where = f"preview_id = {lance_io.sql_literal(preview_id)} AND position = {int(position)}"
    rows = lance_io.read_table(uri, ["thumbnail"], where, storage.lance_storage_options()).to_pylist()
    return rows[0]["thumbnail"] or None if rows else None
