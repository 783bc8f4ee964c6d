"""64-bit DCT perceptual hash (pHash): one of the match keys of the global `duplicates` asset.

Same definition as `imagehash.phash` (hash_size=8, highfreq_factor=4): luma, 32x32 Lanczos
thumbnail, 2-D DCT-II (scipy.fftpack scaling), top-left 8x8, bit = coefficient > median of
those 64, row-major with the first coefficient as the most significant bit, so that
`phash(im) == int(str(imagehash.phash(im)), 16)` in the common case. Hashes are unsigned 64-bit
(Python `int` in [0, 2**64), NumPy/Arrow/Lance `uint64`); nearly every photo sets the top bit
(the DC coefficient beats the median), so never store them in a signed int64 column.

Only the reduction differs from imagehash: the thumbnail stays float32 instead of being rounded to
uint8 (rounding at 32x32 turns tiny differences into whole grey levels), and the full-resolution
luma is first box-reduced in float by an integer factor to between 4x and 8x the thumbnail (Pillow
`reducing_gap=4`). That also makes the hash nearly blind to JPEG `draft` pre-scaling (DCT-domain
downscaling is close to a box filter), and it is ~5x faster than imagehash's direct Lanczos with
pillow-simd (3.8 vs 17.4 ms on a 2560x1600 photo, 0.9 vs 4.3 ms at 1248x784).

The hash alone does not find copies reliably: a bit flips whenever a copy moves a coefficient past
the median, so on real photos 10-15% of re-encodes and resizes differ from their original in 2-8
bits, whatever the reduction. `duplicates` therefore matches on several rank boundaries and
confirms by a signature (prx_core.image.fingerprint); what that finds, through the pipeline on
labelled real photos, is in docs/benchmarks.md (`prx-bench dedup`). The exact-match rates of
the hash alone (the original and its copies hashed outside the pipeline, 125 photos: 15
scikit-image photos, 20 wallpapers, 5 half-size crops of each of the 18 JPEG ones; `draft` = full vs
1/4 draft decode of one q90 JPEG; last column = Hamming distance to `imagehash.phash`, median / mean):

    reduction                   q75   q85   q95   resize50  draft  vs imagehash
    imagehash (uint8 Lanczos)   0.88  0.89  0.90  0.88      0.84   0 / 0.00
    float Lanczos               0.93  0.96  0.98  0.98      0.96   0 / 0.35
    float, box 256x256 first    0.94  0.94  0.98  0.89      0.80   0 / 0.38
    float, reducing_gap=4 (us)  0.92  0.98  0.99  0.97      0.94   0 / 0.38

Callers pass RGB (after EXIF transposition); any other mode is converted to RGB first, so an
RGBA, L or P image hashes exactly like its RGB conversion (alpha is ignored).
"""

from __future__ import annotations

import io
from collections import defaultdict

import numpy as np
from PIL import Image

HASH_SIZE = 8
PHASH_DECODE_SIZE = (128, 128)  # a JPEG is DCT-scaled to no smaller than this before hashing
THUMB_SIZE = 32
REDUCING_GAP = 4.0

# Unnormalized DCT-II rows, as scipy.fftpack.dct(norm=None): every coefficient gets the same
# scale. An orthonormal DCT would scale row/column 0 differently and move bits vs the median.
_k = np.arange(THUMB_SIZE)
_DCT = (2.0 * np.cos(np.pi * np.outer(_k, 2 * _k + 1) / (2 * THUMB_SIZE)))[:HASH_SIZE]
# Rounding the coefficients turns float noise around exact zeros (flat or symmetric images)
# into true ties, so such images hash the same on every machine and in every batch.
_DECIMALS = 3


def canonical_thumbnail(image: Image.Image) -> np.ndarray:
    """The 32x32 float32 luma thumbnail both `phash` and `phash_batch` hash."""
    if image.mode not in ("RGB", "L"):
        image = image.convert("RGB")
    luma = image if image.mode == "L" else image.convert("L")
    thumb = luma.convert("F").resize(
        (THUMB_SIZE, THUMB_SIZE), Image.Resampling.LANCZOS, reducing_gap=REDUCING_GAP
    )
    return np.asarray(thumb, dtype=np.float32)


def dct_coefficients(pixels: np.ndarray) -> np.ndarray:
    """The rounded 8x8 low-frequency DCT coefficients of 32x32 thumbnails, flattened ((..., 32, 32)
    -> (..., 64)): what a pHash thresholds at their median, and what `fingerprint` keys are cut from."""
    pixels = np.asarray(pixels, dtype=np.float64)
    return np.round(_DCT @ pixels @ _DCT.T, _DECIMALS).reshape(*pixels.shape[:-2], HASH_SIZE**2)


def phash_batch(pixels: np.ndarray) -> np.ndarray:
    """Hash (N, 32, 32) grayscale thumbnails at once; returns (N,) uint64."""
    pixels = np.asarray(pixels, dtype=np.float64)
    if pixels.ndim != 3 or pixels.shape[1:] != (THUMB_SIZE, THUMB_SIZE):
        raise ValueError(f"expected (N, 32, 32) thumbnails, got shape {pixels.shape}")
    coeffs = dct_coefficients(pixels)
    bits = coeffs > np.median(coeffs, axis=1, keepdims=True)
    return np.packbits(bits, axis=1).view(">u8")[:, 0].astype(np.uint64)


def phash(image: Image.Image) -> int:
    """Hash one image as an unsigned 64-bit int; bit-identical to `phash_batch`."""
    return int(phash_batch(canonical_thumbnail(image)[None])[0])


def hamming(a: int, b: int) -> int:
    """Number of differing bits between two hashes."""
    return (int(a) ^ int(b)).bit_count()


def hamming_many(hashes: np.ndarray, h: int | np.ndarray) -> np.ndarray:
    """Hamming distance from every uint64 hash in `hashes` to `h` (or to the hash at the same
    position of an array `h`), as uint8."""
    xor = np.bitwise_xor(np.asarray(hashes, dtype=np.uint64), np.asarray(h, dtype=np.uint64))
    if hasattr(np, "bitwise_count"):  # numpy >= 2.0
        return np.bitwise_count(xor).astype(np.uint8)
    bits = np.unpackbits(xor.reshape(-1, 1).view(np.uint8), axis=1)
    return bits.sum(axis=1, dtype=np.uint8).reshape(xor.shape)


def _jpeg_bytes(image: Image.Image, quality: int) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def _decode(data: bytes, scale: int = 1) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    if scale > 1:
        image.draft("RGB", (max(1, image.width // scale), max(1, image.height // scale)))
    return image.convert("RGB")


def measure_exact_match(images: list[Image.Image]) -> dict[str, float]:
    """How often `phash` survives re-encoding, halving and `draft` decoding (rate of distance 0).

    `draft` compares a full and a 1/4 draft decode of the same q90 JPEG. Adds
    `median_distance_to_imagehash` when the test-only `imagehash` package is installed.
    """
    matches: dict[str, list[bool]] = defaultdict(list)
    rgbs = [image.convert("RGB") for image in images]
    for rgb in rgbs:
        base = phash(rgb)
        for quality in (75, 85, 95):
            reencoded = _decode(_jpeg_bytes(rgb, quality))
            matches[f"reencode_q{quality}"].append(phash(reencoded) == base)
        half_size = (max(1, rgb.width // 2), max(1, rgb.height // 2))
        half = rgb.resize(half_size, Image.Resampling.LANCZOS)
        matches["resize50"].append(phash(half) == base)
        data = _jpeg_bytes(rgb, 90)
        matches["draft"].append(phash(_decode(data)) == phash(_decode(data, scale=4)))
    rates = {key: float(np.mean(values)) for key, values in matches.items()}
    try:
        import imagehash
    except ImportError:
        return rates
    distances = [hamming(phash(rgb), int(str(imagehash.phash(rgb)), 16)) for rgb in rgbs]
    rates["median_distance_to_imagehash"] = float(np.median(distances))
    return rates
