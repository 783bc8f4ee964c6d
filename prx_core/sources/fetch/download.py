"""Metadata-only sources: each ingest unit fetches its own rows' images, on its worker.

A table with `url_column` (LAION, DataComp, COYO: url, caption, width, similarity, ...) carries no
image bytes. Its rows' URLs (and the URL paths of Hugging Face `Image()` structs) are fetched in a
sliding window over the reader's batches (`prx_core.sources.fetch.window`): http and https through
`prx_core.sources.fetch.client` (per-host bounds, timeouts, one deadline per URL, retries,
redirects, the size cap, `X-Robots-Tag` opt-outs: `prx_core.sources.fetch.robots`); s3:// keys, other
object-store URIs, `file://` URLs and absolute local paths through fsspec (`read_file`), one
ranged read of at most the size cap each. Every failure is a reject of its row naming the URL
(`download_error`, `download_timeout`, `not_fetched`, `opted_out`, `image_too_large`), never a
failed unit; a fetched image goes on to be validated like any other. The URL is kept per sample
(`source_url`).
"""

from __future__ import annotations

import os
from typing import Any

from prx_core.sources.fetch.client import Fetched
from prx_core.sources.records import DOWNLOAD_ERROR, IMAGE_TOO_LARGE
from prx_core.store.storage import filesystem_for, is_remote

MESSAGE_CHARS = 300
# Columns of a URL table kept as `samples.metadata` by default, matched case-insensitively: what
# LAION-400M/5B (WIDTH, HEIGHT, similarity, punsafe, pwatermark, LICENSE, NSFW, hash), DataComp
# (original_width, clip_*_similarity_score, sha256), COYO-700M (clip_similarity_*, *_score,
# image_phash) and img2dataset's output (original_width, exif) describe their images with.
URL_METADATA_COLUMNS = frozenset({
    "width", "height", "original_width", "original_height", "similarity", "license", "nsfw", "punsafe",
    "pwatermark", "aesthetic", "aesthetic_score", "hash", "sha256", "language", "exif",
    "clip_b32_similarity_score", "clip_l14_similarity_score", "clip_similarity_vitb32", "clip_similarity_vitl14",
    "watermark_score", "aesthetic_score_laion_v2", "nsfw_score_opennsfw2", "nsfw_score_gantman", "image_phash",
})


def url_metadata_columns(spec: Any, names: list[str]) -> list[str]:
    """The columns of a URL table's file (`names`, spelled as the file spells them) kept as metadata
    by default: those named in `URL_METADATA_COLUMNS`, never a column the spec reads otherwise."""
    taken = {c.lower() for c in (spec.url_column, spec.caption_column, spec.key_column, spec.embedding_column,
                                 spec.image_column) if c}
    return [name for name in names if name.lower() in URL_METADATA_COLUMNS and name.lower() not in taken]


def read_file(url: str, storage_options: dict[str, Any] | None, max_bytes: int) -> Fetched:
    """One object or file through fsspec: a single ranged read of `max_bytes + 1` bytes, so an
    oversized one is known without reading it whole (and a missing one is one request)."""
    path = url[len("file://"):] if url.startswith("file://") else url
    if not (is_remote(path) or os.path.isabs(path)):
        return Fetched(reason=DOWNLOAD_ERROR, cause="not an http(s) or object-store URL, nor an absolute path")
    try:
        data = filesystem_for(path, storage_options).cat_file(path, start=0, end=max_bytes + 1)
    except FileNotFoundError:
        return Fetched(reason=DOWNLOAD_ERROR, cause="no such object or file")
    except Exception as exc:  # an unreachable store, a folder, no permission: this row's cause
        return Fetched(reason=DOWNLOAD_ERROR, cause=f"{type(exc).__name__}: {exc}"[:160])
    if len(data) > max_bytes:
        return Fetched(reason=IMAGE_TOO_LARGE, cause=f"over the limit {max_bytes} bytes")
    return Fetched(data=bytes(data))


def describe(cause: str, url: str) -> str:
    """`<cause>: <url>` under `MESSAGE_CHARS`, the URL shortened in the middle when it is long."""
    cause = cause[:160]
    room = MESSAGE_CHARS - len(cause) - 2
    if len(url) > room:
        half = (room - 3) // 2
        url = f"{url[:half]}...{url[-half:]}"
    return f"{cause}: {url}"


def is_http(url: str) -> bool:
    return url[:8].lower().startswith(("http://", "https://"))
