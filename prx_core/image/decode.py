"""Safe decoding of untrusted image bytes into upright 8-bit RGB.

pillow-simd lags Pillow's security fixes, so only an allow-list of formats ever reaches a
decoder, the pixel count is checked from the header before any pixel is decoded, and truncated
or corrupt data is refused instead of padded (`prx_core.image.integrity` checks what Pillow's
decoders skip). CPU bombs under the pixel cap are refused before decoding (JPEG scans and markers,
PNG chunks: `prx_core.image.structure`; inflating past the header's size: `integrity`), and what
they miss is bounded by a per-sample decode budget (`prx_core.image.budget`, `decode_timeout`).
Every decode path (ingest, mds_shards, pHash, captions, the explorer) goes through `open_image`
and `decode_opened`. High-bit-depth and float images become 8-bit band by band, never as a
float64 copy. Every refusal is a `Rejection` with a stable reason code; no exception escapes to
the caller.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageCms, ImageFile, ImageOps, UnidentifiedImageError

from prx_core.image.broken import CORRUPT, Broken
from prx_core.image.budget import (
    DECODE_TIMEOUT,
    DEFAULT_DECODE_SECONDS,
    BudgetedReader,
    Deadline,
    attach,
    deadline_of,
)
from prx_core.image.integrity import check_container, check_riff
from prx_core.image.structure import TOO_MANY_CHUNKS, TOO_MANY_SCANS, TOO_MANY_SEGMENTS, check_structure

ALLOWED_FORMATS: tuple[str, ...] = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
DEFAULT_MAX_PIXELS = 100_000_000

# Stable reason codes (also used by `prx_core.image.buckets`: below_floor, aspect_ratio).
EMPTY = "empty"
NOT_AN_IMAGE = "not_an_image"
FORMAT_NOT_ALLOWED = "format_not_allowed"
TOO_MANY_PIXELS = "too_many_pixels"
TRUNCATED = "truncated"
DECODE_ERROR = "decode_error"
CORRUPT_IMAGE = CORRUPT  # a checksum or a compressed stream that does not hold: never filler pixels
# CPU bombs under the pixel cap (prx_core.image.structure, prx_core.image.budget).
BOMB_REASONS = (TOO_MANY_SCANS, TOO_MANY_SEGMENTS, TOO_MANY_CHUNKS, DECODE_TIMEOUT)
SCALE_BAND_BYTES = 4 << 20  # source bytes converted at once from a 16-bit, 32-bit or float image

# Magic numbers of formats we recognise but refuse, so the reject says which format it was
# without running that format's (possibly vulnerable) plugin.
_REFUSED_SIGNATURES: tuple[tuple[bytes, str], ...] = (
    (b"P1", "PBM"), (b"P2", "PGM"), (b"P3", "PPM"), (b"P4", "PBM"), (b"P5", "PGM"), (b"P6", "PPM"),
    (b"8BPS", "PSD"), (b"\x00\x00\x01\x00", "ICO"), (b"%PDF", "PDF"), (b"%!PS", "EPS"),
    (b"\x00\x00\x00\x0cjP  ", "JPEG2000"), (b"\xff\x4f\xff\x51", "JPEG2000"), (b"icns", "ICNS"),
    (b"DDS ", "DDS"), (b"qoif", "QOI"), (b"\x0a\x05\x01", "PCX"),
)

_ALLOWED_SIGNATURES: tuple[tuple[bytes, str], ...] = (
    (b"\xff\xd8\xff", "JPEG"), (b"\x89PNG\r\n\x1a\n", "PNG"), (b"GIF8", "GIF"), (b"BM", "BMP"),
    (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"),
)

_sRGB = ImageCms.createProfile("sRGB")
# The pixel cap is enforced here, from the header; Pillow's own warning below it is noise.
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


@dataclass(frozen=True)
class Rejection:
    """Why an input was refused: a machine-readable `reason` and a short `message`."""

    reason: str
    message: str


def sniff_refused_format(data: bytes) -> str | None:
    head = data[:16]
    for signature, name in _REFUSED_SIGNATURES:
        if head.startswith(signature) and (name not in ("PBM", "PGM", "PPM") or head[2:3].isspace()):
            return name
    if head[4:8] == b"ftyp":
        return "HEIF/AVIF"
    if head.lstrip().lower().startswith((b"<svg", b"<?xml")):
        return "SVG"
    return None


def open_image(
    data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS, budget_s: float = DEFAULT_DECODE_SECONDS
) -> ImageFile.ImageFile | Rejection:
    """Parse the header (format allow-list, pixel cap) and check the container's structure (scan,
    marker and chunk counts) and integrity (CRCs, stream lengths: no pixel buffer); nothing
    decoded yet. The sample's decode budget of `budget_s` starts here and travels with the image."""
    if not data:
        return Rejection(EMPTY, "zero-byte input")
    deadline = Deadline(budget_s)
    try:
        check_riff(data)  # before Pillow, which reports a cut WebP as an unreadable header
        check_structure(data)  # before Pillow, whose marker and chunk parsing is per piece in Python
    except Broken as exc:
        return Rejection(exc.reason, str(exc))
    if max_pixels > (Image.MAX_IMAGE_PIXELS or 0):
        Image.MAX_IMAGE_PIXELS = max_pixels  # Pillow's own bomb check must not be the stricter one
    try:
        reader = BudgetedReader(io.BytesIO(data), deadline)
        image = Image.open(reader, formats=ALLOWED_FORMATS)  # type: ignore[arg-type]
    except Broken as exc:  # the budget, spent while Pillow parsed the header
        return Rejection(exc.reason, str(exc))
    except UnidentifiedImageError:
        variant = next((name for sig, name in _ALLOWED_SIGNATURES if data.startswith(sig)), None)
        if variant:
            return Rejection(DECODE_ERROR, f"unsupported or corrupt {variant} variant (header not readable)")
        refused = sniff_refused_format(data)
        if refused:
            return Rejection(FORMAT_NOT_ALLOWED, f"{refused} is not an allowed format ({', '.join(ALLOWED_FORMATS)})")
        return Rejection(NOT_AN_IMAGE, f"not a recognised image ({len(data)} bytes: {kind_of_bytes(data)})")
    except Image.DecompressionBombError as exc:
        return Rejection(TOO_MANY_PIXELS, str(exc))
    except Exception as exc:  # a header so broken the plugin itself fails
        return Rejection(TRUNCATED if len(data) < 64 else DECODE_ERROR, f"bad header: {type(exc).__name__}: {exc}")
    width, height = image.size
    if width <= 0 or height <= 0:
        return Rejection(DECODE_ERROR, f"invalid size {width}x{height}")
    if width * height > max_pixels:
        return Rejection(TOO_MANY_PIXELS, f"{width}x{height} = {width * height / 1e6:.0f} MP exceeds the {max_pixels / 1e6:.0f} MP cap")
    try:
        check_container(data, image, deadline)
    except Broken as exc:
        return Rejection(exc.reason, str(exc)[:300])
    attach(image, deadline)
    return image


def exif_orientation(image: Image.Image) -> int:
    try:
        value = image.getexif().get(0x0112, 1)
        return value if value in range(1, 9) else 1
    except Exception:  # malformed EXIF must not reject an otherwise good image
        return 1


def upright_size(image: Image.Image, orientation: int) -> tuple[int, int]:
    """The size after applying the EXIF orientation (5-8 swap width and height)."""
    return _oriented(image.size, orientation)


def _oriented(size: tuple[int, int], orientation: int) -> tuple[int, int]:
    """Map a size between stored and upright axes (the mapping is its own inverse)."""
    return (size[1], size[0]) if orientation in (5, 6, 7, 8) else size


def load_pixels(image: ImageFile.ImageFile) -> Rejection | None:
    """Decode the pixels; truncated data is an error here, never grey padding."""
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        return Rejection(DECODE_ERROR, "PIL.ImageFile.LOAD_TRUNCATED_IMAGES is set: refusing to load padded data")
    try:
        image.load()
    except Broken as exc:  # the decode budget, spent between two reads
        return Rejection(exc.reason, str(exc))
    except Exception as exc:
        text = str(exc)
        truncated = "truncated" in text or "broken data stream" in text or isinstance(exc, EOFError)
        return Rejection(TRUNCATED if truncated else DECODE_ERROR, f"{type(exc).__name__}: {text}"[:300])
    return None


def apply_orientation(image: Image.Image, orientation: int) -> Image.Image:
    if orientation == 1:
        return image
    transposed = ImageOps.exif_transpose(image)
    return transposed if transposed is not None else image


def to_rgb(image: Image.Image) -> Image.Image:
    """Any Pillow mode to 8-bit RGB: transparency over white, CMYK through its ICC profile,
    high-bit-depth and float modes scaled to 0-255."""
    mode = image.mode
    if mode == "RGB":
        return image
    if mode in ("RGBA", "LA", "PA", "RGBa", "La") or (mode == "P" and "transparency" in image.info) or (
        mode in ("L", "RGB") and "transparency" in image.info
    ):
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    if mode == "CMYK":
        return cmyk_to_rgb(image)
    if mode.startswith("I") or mode == "F":
        return _scale_to_8bit(image).convert("RGB")
    return image.convert("RGB")  # L, P, 1, YCbCr, LAB, HSV


def cmyk_to_rgb(image: Image.Image) -> Image.Image:
    icc = image.info.get("icc_profile")
    if icc:
        try:
            source = ImageCms.ImageCmsProfile(io.BytesIO(icc))
            return ImageCms.profileToProfile(image, source, _sRGB, outputMode="RGB")
        except Exception:  # a broken profile: fall back to the naive conversion below
            pass
    return image.convert("RGB")


def _scale_to_8bit(image: Image.Image) -> Image.Image:
    """16/32-bit integer and float images to L by the nominal range of the data, in bands of
    `SCALE_BAND_BYTES` (float32): memory beyond the source is the 8-bit result and one band,
    where a float64 copy of a 10 MP 16-bit PNG took 175 MB."""
    width, height = image.size
    rows = max(1, SCALE_BAND_BYTES // max(1, width * 4))
    bands = [(top, min(height, top + rows)) for top in range(0, height, rows)]
    peak = 0.0
    for top, bottom in bands:
        band = _band(image, top, bottom)
        finite = band[np.isfinite(band)] if image.mode == "F" else band
        peak = max(peak, float(finite.max(initial=0.0)))
    if image.mode == "F":
        scale = 1.0 if peak <= 1.0 else 255.0 if peak <= 255.0 else peak
    else:
        scale = 255.0 if peak <= 255 else 65535.0 if peak <= 65535 else float(2**32 - 1)
    out = np.empty((height, width), np.uint8)
    for top, bottom in bands:
        band = _band(image, top, bottom)
        band *= np.float32(255.0 / scale)
        np.nan_to_num(band, copy=False, nan=0.0, posinf=255.0, neginf=0.0)
        np.rint(band, out=band)
        np.clip(band, 0, 255, out=band)
        out[top:bottom] = band
    return Image.fromarray(out, "L")


def _band(image: Image.Image, top: int, bottom: int) -> np.ndarray:
    """Rows [top, bottom) of a one-band image as float32 (a copy of the band only)."""
    return np.asarray(image.crop((0, top, image.width, bottom))).astype(np.float32)


@dataclass(frozen=True)
class Decoded:
    """An upright RGB image and what was learned about the source on the way."""

    image: Image.Image
    format: str
    mode: str  # the source's Pillow mode before conversion
    original_size: tuple[int, int]  # upright, full resolution
    orientation: int
    draft_scale: int  # 1, 2, 4 or 8 (JPEG DCT-domain downscale)


def decode_image(
    data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS, min_size: tuple[int, int] | None = None,
    budget_s: float = DEFAULT_DECODE_SECONDS,
) -> Decoded | Rejection:
    """Decode to upright RGB; with `min_size` (upright), a JPEG is DCT-scaled to the smallest
    scale still at least that size."""
    try:
        opened = open_image(data, max_pixels, budget_s)
        if isinstance(opened, Rejection):
            return opened
        return decode_opened(opened, min_size)
    except Exception as exc:  # the contract: a Rejection, never an exception
        return Rejection(DECODE_ERROR, f"{type(exc).__name__}: {exc}"[:300])


def decode_opened(
    image: ImageFile.ImageFile, min_size: tuple[int, int] | None = None, orientation: int | None = None
) -> Decoded | Rejection:
    """Decode an `open_image` result; pass `orientation` when the caller already read the EXIF.
    The sample's decode budget is checked between the stages."""
    deadline = deadline_of(image)
    try:
        orientation = exif_orientation(image) if orientation is None else orientation
        original = upright_size(image, orientation)
        fmt, mode, stored = image.format or "?", image.mode, image.size
        if image.format == "JPEG" and min_size is not None:
            want = _oriented(min_size, orientation)
            image.draft(None, (max(1, want[0]), max(1, want[1])))
        deadline.check("reading the EXIF")  # a PNG's EXIF is read by loading it, errors swallowed
        if (failure := load_pixels(image)) is not None:
            return failure
        deadline.check("decoding")
        scale = max(1, round(stored[0] / image.size[0]))
        upright = apply_orientation(image, orientation)
        deadline.check("orientation")
        rgb = to_rgb(upright)
        deadline.check("conversion to RGB")
    except Broken as exc:
        return Rejection(exc.reason, str(exc))
    return Decoded(rgb, fmt, mode, original, orientation, scale)


def kind_of_bytes(data: bytes) -> str:
    """What a non-image looks like, in words: a reject's message (stored, and shown by the explorer)
    never carries the file's own bytes."""
    head = data[:512]
    if head[:8].lower().startswith((b"http://", b"https://", b"s3://", b"file://")):
        return "text that starts like a URL"
    for magic, name in ((b"\x1f\x8b", "gzip data"), (b"PK\x03\x04", "a zip archive"), (b"%PDF", "a PDF")):
        if head.startswith(magic):
            return name
    printable = sum(32 <= b < 127 or b in (9, 10, 13) for b in head)
    if head and printable >= 0.95 * len(head):
        return "HTML or XML text" if head.lstrip()[:1] == b"<" else "text"
    return "binary data of no known image format"
