"""Metadata-only sources: each ingest unit fetches its rows' images (to be written: issue 22)."""

from __future__ import annotations

from typing import Any


def url_metadata_columns(spec: Any, names: list[str]) -> list[str]:
    """The columns of a URL table kept as metadata by default (width, height, similarity, ...)."""
    return []


def fetch_rows(spec: Any, rows: Any, storage_options: dict[str, Any] | None) -> None:
    """Fetch every live row with no image bytes and a URL."""
    raise NotImplementedError("url sources are not readable yet")
