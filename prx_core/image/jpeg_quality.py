"""Estimate the quality a JPEG was saved with, from its quantization tables alone.

Runs on every image of the corpus, so it parses the header only (never decodes pixels) and
never raises: anything that is not a readable JPEG header gives `None`.

The estimate is the IJG quality 1..100 whose scaled Annex K tables are closest (least squares)
to the file's tables. It is exact (rmse 0) for anything built on libjpeg's jpeg_set_quality
(libjpeg-turbo, Pillow, ImageMagick, ...); for encoders with their own tables (Photoshop,
cameras, mozjpeg's defaults) it is the nearest IJG quality, and `rmse` says how far off that is.

Table order: JPEG files store tables in zigzag order. Pillow >= 8.3 de-zigzags them on read
(python-pillow/Pillow#4989), so `JpegImageFile.quantization` is in natural (row-major) order,
the same order as libjpeg's `std_*_quant_tbl`; older Pillow returned the raw zigzag order.
`_pillow_gives_natural_order` checks which, once per process, on a JPEG Pillow encodes.
"""

from __future__ import annotations

import io
from functools import cache
from typing import NamedTuple

import numpy as np
from PIL import Image, JpegImagePlugin

# ITU-T T.81 Annex K.1 / libjpeg jcparam.c `std_luminance_quant_tbl`, natural order.
_LUMA_BASE = np.array(
    [
        [16, 11, 10, 16, 24, 40, 51, 61],
        [12, 12, 14, 19, 26, 58, 60, 55],
        [14, 13, 16, 24, 40, 57, 69, 56],
        [14, 17, 22, 29, 51, 87, 80, 62],
        [18, 22, 37, 56, 68, 109, 103, 77],
        [24, 35, 55, 64, 81, 104, 113, 92],
        [49, 64, 78, 87, 103, 121, 120, 101],
        [72, 92, 95, 98, 112, 100, 103, 99],
    ],
    dtype=np.int64,
)

# ITU-T T.81 Annex K.2 / libjpeg jcparam.c `std_chrominance_quant_tbl`, natural order.
_CHROMA_BASE = np.full((8, 8), 99, dtype=np.int64)
_CHROMA_BASE[:4, :4] = [
    [17, 18, 24, 47],
    [18, 21, 26, 66],
    [24, 26, 56, 99],
    [47, 66, 99, 99],
]

# Natural-order index of the k-th coefficient in zigzag order (libjpeg's jpeg_natural_order).
_ZIGZAG_TO_NATURAL = np.array(
    [
        0, 1, 8, 16, 9, 2, 3, 10, 17, 24, 32, 25, 18, 11, 4, 5,
        12, 19, 26, 33, 40, 48, 41, 34, 27, 20, 13, 6, 7, 14, 21, 28,
        35, 42, 49, 56, 57, 50, 43, 36, 29, 22, 15, 23, 30, 37, 44, 51,
        58, 59, 52, 45, 38, 31, 39, 46, 53, 60, 61, 54, 47, 55, 62, 63,
    ]
)  # fmt: skip

QUALITIES = np.arange(1, 101)

JpegSource = bytes | bytearray | memoryview | Image.Image


class JpegQuality(NamedTuple):
    """An IJG quality estimate and how well the file's tables fit it."""

    quality: int
    rmse: float  # per-coefficient RMS distance to the IJG tables at `quality`; 0.0 = exact


def scale_table(base: np.ndarray, quality: int, force_baseline: bool = True) -> np.ndarray:
    """Scale a base table exactly as libjpeg's jpeg_set_quality does (integer arithmetic)."""
    quality = min(max(int(quality), 1), 100)
    scale = 5000 // quality if quality < 50 else 200 - 2 * quality
    table = np.clip((base * scale + 50) // 100, 1, 32767)
    # Pillow (and cjpeg by default) pass force_baseline=TRUE: 8-bit tables, capped at 255.
    return np.minimum(table, 255) if force_baseline else table


def standard_tables(quality: int) -> tuple[np.ndarray, np.ndarray]:
    """The (luma, chroma) 8x8 tables, natural order, libjpeg writes at `quality`."""
    return scale_table(_LUMA_BASE, quality), scale_table(_CHROMA_BASE, quality)


@cache
def _candidates() -> np.ndarray:
    """All IJG tables, shape (100 qualities, 2 kinds, 64), built once per process."""
    return np.stack(
        [np.stack([t.reshape(64) for t in standard_tables(int(q))]) for q in QUALITIES]
    ).astype(np.float64)


@cache
def _pillow_gives_natural_order() -> bool:
    """Whether this Pillow de-zigzags `quantization`: probed, not assumed, since forks lag.

    The unscaled (q=50) luma table reads back unchanged only if Pillow de-zigzags it.
    """
    buffer = io.BytesIO()
    Image.new("L", (8, 8)).save(buffer, format="JPEG", quality=50)
    with JpegImagePlugin.JpegImageFile(io.BytesIO(buffer.getvalue())) as image:
        table = np.asarray(image.quantization[0])
    return bool(np.array_equal(table, _LUMA_BASE.reshape(64)))


def _read_tables(source: JpegSource) -> np.ndarray | None:
    """The quantization tables as a (n, 64) natural-order array, or None if there are none."""
    if isinstance(source, Image.Image):
        tables = getattr(source, "quantization", None)
    else:
        data = bytes(source)
        if not data.startswith(b"\xff\xd8\xff"):  # cheap reject of non-JPEG bytes
            return None
        # JpegImageFile directly, not Image.open: only the JPEG header is parsed, and
        # Image.open's decompression-bomb guard would reject huge images we never decode.
        with JpegImagePlugin.JpegImageFile(io.BytesIO(data)) as image:
            tables = image.quantization
    if not tables:
        return None
    rows = [np.asarray(tables[key], dtype=np.float64) for key in sorted(tables)]
    if any(row.shape != (64,) for row in rows):
        return None
    array = np.stack(rows)
    return array if _pillow_gives_natural_order() else array[:, np.argsort(_ZIGZAG_TO_NATURAL)]


def estimate_jpeg_quality_with_error(source: JpegSource) -> JpegQuality | None:
    """Like `estimate_jpeg_quality`, plus the fit's RMSE to flag non-IJG (custom) tables."""
    try:
        tables = _read_tables(source)
    except Exception:  # corrupt headers raise anything from SyntaxError to struct.error
        return None
    if tables is None:
        return None
    # First table is luma; every further one (Cb, Cr, sometimes a separate Cr) is chroma.
    kinds = np.minimum(np.arange(len(tables)), 1)
    errors = ((_candidates()[:, kinds, :] - tables) ** 2).sum(axis=(1, 2))
    best = int(np.argmin(errors))
    return JpegQuality(int(QUALITIES[best]), float(np.sqrt(errors[best] / tables.size)))


def estimate_jpeg_quality(source: JpegSource) -> int | None:
    """The IJG quality (1..100) `source` was most likely saved with, or None if not a JPEG.

    `source` is the encoded bytes or an already-opened PIL image (only its header is used).
    """
    estimate = estimate_jpeg_quality_with_error(source)
    return None if estimate is None else estimate.quality
