"""Turn source records into `samples` rows, or `rejects` rows with a reason.

Ingest validates every image by decoding it once, DCT-scaled to the smallest size the pHash
still accepts (truncation still surfaces: the whole entropy stream is read), and records what
later stages need without decoding again: upright size, format, mode, orientation, JPEG quality
and the pHash. Source captions are untrusted text: cleaned and capped here
(prx_core.models.caption_text), with how many were cleaned and truncated counted for the report.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Container
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from prx_core.image.decode import (
    DECODE_ERROR,
    DEFAULT_MAX_PIXELS,
    Rejection,
    decode_opened,
    exif_orientation,
    open_image,
)
from prx_core.image.fingerprint import fingerprint, is_lossless
from prx_core.image.jpeg_quality import estimate_jpeg_quality
from prx_core.image.phash import PHASH_DECODE_SIZE
from prx_core.models.caption_text import DEFAULT_MAX_CAPTION_CHARS, clean_caption
from prx_core.sources.records import BAD_NAME, TAKEN_DOWN, TAKEN_DOWN_MESSAGE, key_problem, safe_key
from prx_core.store import schemas
from prx_core.store.partitions import reject_row


@dataclass(frozen=True)
class ImageFacts:
    width: int
    height: int
    format: str
    mode: str
    orientation: int
    jpeg_quality: int | None
    phash: int
    match_keys: tuple[int, ...]
    signature: bytes
    lossless: bool


def inspect_image(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> ImageFacts | Rejection:
    """Validate by decoding and describe the image, its fingerprint included (pHash, match keys,
    signature: prx_core.image.fingerprint); never raises. The decode is DCT-scaled to what the
    pHash needs (>= 128 px): for a photo of a few megapixels that is the smallest scale libjpeg
    offers anyway, and the `phashes` stage then never decodes again."""
    try:
        opened = open_image(data, max_pixels)
        if isinstance(opened, Rejection):
            return opened
        quality = estimate_jpeg_quality(opened)
        orientation = exif_orientation(opened)
        decoded = decode_opened(opened, min_size=PHASH_DECODE_SIZE, orientation=orientation)
        if isinstance(decoded, Rejection):
            return decoded
        width, height = decoded.original_size
        found = fingerprint(decoded.image)
        return ImageFacts(width, height, decoded.format, decoded.mode, orientation, quality, found.phash,
                          found.match_keys, found.signature, is_lossless(opened, data))
    except Exception as exc:  # the contract: a Rejection, never an exception
        return Rejection(DECODE_ERROR, f"{type(exc).__name__}: {exc}"[:300])


def fingerprint_columns(facts: ImageFacts) -> dict[str, Any]:
    """The `samples` and `phashes` columns `duplicates` reads of an image."""
    return {"phash": facts.phash, "match_keys": list(facts.match_keys), "signature": facts.signature,
            "lossless": facts.lossless}


def content_id(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def ingest_batch(
    source: str, batch: pa.RecordBatch | pa.Table, max_pixels: int = DEFAULT_MAX_PIXELS,
    max_caption_chars: int = DEFAULT_MAX_CAPTION_CHARS, counts: Counter[str] | None = None,
    taken_down: Container[str] = frozenset(),
) -> tuple[pa.Table, pa.Table]:
    """Split source records (`prx_core.sources.readers.RECORD_SCHEMA`) into samples and rejects.
    Captions of accepted samples are cleaned and capped; `counts` (if given) gains
    `captions_cleaned` and `captions_truncated`. A key in `taken_down` is a `taken_down` reject
    whatever its bytes (`prx_core.stages.opt_out.takedowns`)."""
    counts = Counter() if counts is None else counts
    samples: list[dict[str, Any]] = []
    rejects: list[dict[str, Any]] = []
    for record in batch.to_pylist():
        data: bytes = record["image"] or b""
        key = record["source_key"]
        if (problem := key_problem(key)) is not None:  # every format's keys pass here, once
            key = safe_key(key)
            rejects.append(reject_row(schemas.sample_id(source, key), source, key, None, "samples", BAD_NAME, problem))
            continue
        sid = schemas.sample_id(source, key)
        if key in taken_down and record.get("reject_reason") != TAKEN_DOWN:  # a file source's: read, never kept
            rejects.append(reject_row(sid, source, key, None, "samples", TAKEN_DOWN, TAKEN_DOWN_MESSAGE))
            continue
        if record.get("reject_reason"):  # refused by the reader (a link, an oversized member, a repeated key)
            rejects.append(reject_row(sid, source, key, None, "samples", record["reject_reason"],
                                      record.get("reject_message") or ""))
            continue
        cid = content_id(data)
        facts = inspect_image(data, max_pixels)
        if isinstance(facts, Rejection):
            rejects.append(reject_row(sid, source, key, cid, "samples", facts.reason, facts.message))
            continue
        caption = clean_caption(record["caption"], max_caption_chars)
        counts.update(captions_cleaned=int(caption.cleaned), captions_truncated=int(caption.truncated))
        samples.append(
            {
                "sample_id": sid,
                "content_id": cid,
                "source": source,
                "source_key": key,
                "image": data,
                "width": facts.width,
                "height": facts.height,
                "format": facts.format,
                "mode": facts.mode,
                "orientation": facts.orientation,
                "jpeg_quality": facts.jpeg_quality,
                "num_bytes": len(data),
                "original_caption": caption.text,
                "embedding": record["embedding"],
                "metadata": record.get("metadata") or None,
                "source_url": record.get("source_url"),
                **fingerprint_columns(facts),
            }
        )
    return (
        pa.Table.from_pylist(samples, schema=schemas.SAMPLES),
        pa.Table.from_pylist(rejects, schema=schemas.REJECTS),
    )
