"""The one-decode image transform every corpus image goes through.

Decode once, DCT-scaled (JPEG `draft`) to the smallest scale that still covers the bucket, then
from that single decode: the pHash of the whole picture, the centred minimal crop to the
bucket's aspect ratio, a Lanczos resize to exactly the bucket, and a JPEG quality-92 encode.
The naive path (full decode for the hash, decode again to resize) costs 1.8x more with every
tier allowed and 3.3x more with the tier capped at 1024 (docs/benchmarks.md).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

from PIL import Image

from prx_core.image.broken import Broken
from prx_core.image.budget import DEFAULT_DECODE_SECONDS, deadline_of
from prx_core.image.buckets import TIERS, Bucket, Drop, assign_bucket, crop_box
from prx_core.image.decode import (
    DECODE_ERROR,
    DEFAULT_MAX_PIXELS,
    Rejection,
    decode_opened,
    exif_orientation,
    open_image,
    upright_size,
)
from prx_core.image.jpeg_quality import estimate_jpeg_quality
from prx_core.image.phash import phash

OUTPUT_QUALITY = 92
OUTPUT_SUBSAMPLING = 2  # 4:2:0, Pillow's default for this quality, stated so it never drifts


@dataclass(frozen=True)
class Processed:
    """What the corpus stores for one image: the bucketed JPEG and the facts about its source."""

    jpeg: bytes
    bucket: Bucket
    original_size: tuple[int, int]  # upright, full resolution
    phash: int | None  # None when not asked for (`facts=False`)
    source_quality: int | None  # estimated JPEG quality of the source; None for other formats or `facts=False`
    source_format: str
    source_mode: str
    orientation: int
    draft_scale: int


def draft_target(original: tuple[int, int], bucket: Bucket) -> tuple[int, int]:
    """The smallest upright decode size whose minimal crop still covers the bucket."""
    width, height = original
    left, top, right, bottom = crop_box(width, height, bucket)
    scale = max(bucket.width / (right - left), bucket.height / (bottom - top))
    return (math.ceil(width * scale), math.ceil(height * scale))


def encode_jpeg(image: Image.Image, quality: int = OUTPUT_QUALITY) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality, subsampling=OUTPUT_SUBSAMPLING)
    return buffer.getvalue()


def resize_to_bucket(image: Image.Image, bucket: Bucket) -> Image.Image:
    """Centre-crop to the bucket's aspect ratio and Lanczos-resize to exactly its size, in one pass."""
    box = crop_box(image.width, image.height, bucket)
    return image.resize(bucket.size, Image.Resampling.LANCZOS, box=box)


def process_image(
    data: bytes,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    quality: int = OUTPUT_QUALITY,
    max_tier: int = TIERS[-1],
    budget_s: float = DEFAULT_DECODE_SECONDS,
    facts: bool = True,
) -> Processed | Rejection:
    """Bytes in, a bucketed JPEG with its pHash out, or a `Rejection`; never raises.

    `facts=False` skips the pHash and the source's JPEG quality (~4.5 of ~35 ms per photo):
    `mds_shards` renders images whose facts ingest already stored in `samples`.

    With every tier allowed an image is at most 1.5x its bucket per side (below 37 MP), so
    DCT scaling pays off mainly when `max_tier` caps the tier (a 1024 corpus from 4K photos).
    The same guards as ingest (`open_image`: structure limits, integrity, the decode budget of
    `budget_s`, checked again between resize, pHash and encode) refuse a bomb here too.
    """
    if max_tier not in TIERS:  # a configuration error, not a property of the image
        raise ValueError(f"unknown max_tier {max_tier}; tiers are {TIERS}")
    try:
        opened = open_image(data, max_pixels, budget_s)
        if isinstance(opened, Rejection):
            return opened
        source_quality = estimate_jpeg_quality(opened) if facts else None
        orientation = exif_orientation(opened)
        upright = upright_size(opened, orientation)
        bucket = assign_bucket(*upright, max_tier=max_tier)
        if isinstance(bucket, Drop):
            return Rejection(bucket.reason, bucket.message)
        decoded = decode_opened(opened, min_size=draft_target(upright, bucket), orientation=orientation)
        if isinstance(decoded, Rejection):
            return decoded
        deadline = deadline_of(opened)
        resized = resize_to_bucket(decoded.image, bucket)
        deadline.check("resize")
        hashed = phash(decoded.image) if facts else None
        deadline.check("pHash")
        jpeg = encode_jpeg(resized, quality)
        deadline.check("encode")
        return Processed(
            jpeg=jpeg,
            bucket=bucket,
            original_size=decoded.original_size,
            phash=hashed,
            source_quality=source_quality,
            source_format=decoded.format,
            source_mode=decoded.mode,
            orientation=decoded.orientation,
            draft_scale=decoded.draft_scale,
        )
    except Broken as exc:  # the decode budget, spent in a stage after the decode
        return Rejection(exc.reason, str(exc))
    except Exception as exc:  # the contract: a Rejection, never an exception
        return Rejection(DECODE_ERROR, f"{type(exc).__name__}: {exc}"[:300])
