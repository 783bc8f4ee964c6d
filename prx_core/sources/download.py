"""Metadata-only sources: each ingest unit fetches its own rows' images, on its worker.

A table with `url_column` (LAION, DataComp, COYO: url, caption, width, similarity, ...) carries no
image bytes. `fetch_rows` fetches a batch's URLs (and the URL paths of Hugging Face `Image()`
structs): http and https through `prx_core.sources.http_fetch` (bounded concurrency, timeouts,
retries, redirects, the size cap, `X-Robots-Tag` opt-outs: `prx_core.sources.robots`); s3:// keys,
other object-store URIs, `file://` URLs and absolute local paths through fsspec, one ranged read
of at most the size cap each. Every failure is a reject of its row naming the URL
(`download_error`, `download_timeout`, `opted_out`, `image_too_large`), never a failed unit; a
fetched image goes on to be validated like any other. The URL is kept per sample (`source_url`).
"""

from __future__ import annotations

import os
from typing import Any

from prx_core.sources.http_fetch import Fetched, fetch_http
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


def fetch_rows(spec: Any, rows: Any, storage_options: dict[str, Any] | None) -> None:
    """Fetch every live row with no image bytes and a URL: its bytes into `rows.images`, or a reject
    naming the URL and the cause. The http(s) URLs first, then the rest, each `concurrency` at a time."""
    wanted = [i for i in rows.live() if rows.images[i] is None and rows.urls[i]]
    web = [i for i in wanted if _is_http(rows.urls[i])]
    files = [i for i in wanted if not _is_http(rows.urls[i])]
    settings, cap = spec.download, spec.max_image_bytes
    outcomes: dict[int, Fetched] = {}
    if web:
        outcomes.update(zip(web, fetch_http([rows.urls[i] for i in web], settings, cap)))
    if files:
        outcomes.update(zip(files, fetch_files([rows.urls[i] for i in files], storage_options, cap,
                                               settings.concurrency)))
    for i, outcome in outcomes.items():
        if outcome.reason is None:
            rows.images[i] = outcome.data
        else:
            rows.refuse(i, outcome.reason, describe(outcome.cause, rows.urls[i]))


def fetch_files(urls: list[str], storage_options: dict[str, Any] | None, max_bytes: int,
                concurrency: int) -> list[Fetched]:
    """Object-store keys and local files, `concurrency` at a time, in order."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(urls)))) as pool:
        return list(pool.map(lambda url: read_file(url, storage_options, max_bytes), urls))


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


def _is_http(url: str) -> bool:
    return url[:8].lower().startswith(("http://", "https://"))
