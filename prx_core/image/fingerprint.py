"""What `duplicates` knows of a picture: match keys that find its copies, and a signature that
confirms them.

**Match keys** (`match_keys`). The pHash sets a bit per low-frequency DCT coefficient above the
median of the 64; a copy's coefficients move by ~0.1-0.3% of their spread (re-encode, resize),
so a bit flips whenever a coefficient sits that close to the median, which on real photos is 10-15%
of copies (docs/benchmarks.md). The keys are the sets of the top k coefficients for several k
(`RANK_KS`, k = 32 is the pHash itself): a copy misses a key only when its ranking changes at
that key's boundary, so it shares at least one of seven keys with its original unless its ranking
changes at all seven. Each key is the 64-bit mask of its set (popcount k, so keys of different k
never collide) and is matched exactly: finding candidates is a shuffle by key, linear in rows.

A picture without visible structure (flat, or a watermark on a flat field: AC amplitude below
`FLAT_LEVELS` grey levels) has a ranking of noise; it is keyed by its colour instead, on two grids
offset by half a cell, so colours closer than half a cell share a key. Near the threshold both
kinds of key are emitted, so a copy on the other side of it still meets its original.

**Signature** (`signature`, 384 bytes): the 16x16 luma and 8x8 chroma of the picture, area
averages of the same decode the hash is taken from. Two pictures that share a key are the same
picture when `signature_distance` <= 1: the same mean brightness and colour (within 2 grey levels:
brightness edits, light and dark themes and tinted flats differ by more) and the same structure
(the rest of the luma differs by at most 1.5 levels plus 8% of its contrast: flips, crops,
rotations and different pictures under one watermark differ by more).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

from prx_core.image.phash import canonical_thumbnail, dct_coefficients

RANK_KS = (8, 16, 24, 32, 40, 48, 56)
FLAT_LEVELS = 0.5  # RMS amplitude of the AC coefficients, in grey levels, below which a picture is flat
FLAT_CELL = 8.0  # colour grid of the flat keys, in levels per channel
SIG_LUMA, SIG_CHROMA = 16, 8
SIGNATURE_BYTES = SIG_LUMA * SIG_LUMA + 2 * SIG_CHROMA * SIG_CHROMA
# confirmation: mean brightness, mean chroma difference, luma residual (levels) and its contrast share
MEAN_LEVELS, CHROMA_LEVELS, RESIDUAL_LEVELS, RESIDUAL_SHARE = 2.0, 2.0, 1.5, 0.08
_AMPLITUDE = 1024.0  # an AC coefficient of a pattern of amplitude 1 level (unnormalized DCT of 32x32)
_FLAT_SEED = np.uint64(0x9E3779B97F4A7C15)


@dataclass(frozen=True)
class Fingerprint:
    phash: int
    match_keys: tuple[int, ...]
    signature: bytes


def fingerprint(image: Image.Image) -> Fingerprint:
    """The pHash, match keys and signature of an upright RGB (or L) image, from one thumbnail."""
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    coeffs = dct_coefficients(canonical_thumbnail(rgb))
    bits = coeffs > np.median(coeffs)
    phash = int(np.packbits(bits).view(">u8")[0])
    signature = compute_signature(rgb)
    amplitude = float(np.sqrt(np.mean(coeffs[1:] ** 2))) / _AMPLITUDE
    keys: list[int] = []
    if amplitude >= FLAT_LEVELS / 2:
        keys += rank_keys(coeffs, phash)
    if amplitude < FLAT_LEVELS * 2:
        keys += flat_keys(signature)
    return Fingerprint(phash, tuple(keys), signature)


def rank_keys(coeffs: np.ndarray, phash: int) -> list[int]:
    """The masks of the top-k coefficient sets (`RANK_KS`); k = 32 is `phash` (the median rule)."""
    order = np.argsort(-coeffs, kind="stable")
    keys = []
    for k in RANK_KS:
        if k == 32:
            keys.append(phash)
            continue
        bits = np.zeros(64, bool)
        bits[order[:k]] = True
        keys.append(int(np.packbits(bits).view(">u8")[0]))
    return keys


def flat_keys(signature: bytes) -> list[int]:
    """Colour cells of a flat picture's mean Y, Cb, Cr on two grids offset by half a cell per
    channel (8 cells: any two colours within half a cell on every channel share one)."""
    y, cb, cr = _planes(np.frombuffer(signature, np.uint8)[None])
    mean = np.array([y.mean(), cb.mean(), cr.mean()])
    keys = []
    for combo in range(8):
        offsets = np.array([(combo >> c) & 1 for c in range(3)]) * FLAT_CELL / 2
        cell = np.floor((mean + offsets) / FLAT_CELL).astype(np.uint64)
        packed = np.uint64(combo) << np.uint64(48) | cell[0] << np.uint64(32) | cell[1] << np.uint64(16) | cell[2]
        keys.append(int(_mix(packed)))
    return keys


def compute_signature(image: Image.Image) -> bytes:
    """16x16 luma then 8x8 Cb and Cr, area averages (resolution-independent), as uint8."""
    ycc = image.convert("YCbCr")
    luma = np.asarray(ycc.getchannel(0).resize((SIG_LUMA, SIG_LUMA), Image.Resampling.BOX), np.uint8)
    chroma = np.asarray(ycc.resize((SIG_CHROMA, SIG_CHROMA), Image.Resampling.BOX), np.uint8)[..., 1:]
    return luma.tobytes() + np.ascontiguousarray(chroma.transpose(2, 0, 1)).tobytes()


def signature_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance between signatures, row by row ((N, 384) uint8 each): <= 1 confirms a pair."""
    ya, cba, cra = _planes(np.asarray(a, np.uint8))
    yb, cbb, crb = _planes(np.asarray(b, np.uint8))
    mean_a, mean_b = ya.mean(axis=1), yb.mean(axis=1)
    da, db = ya - mean_a[:, None], yb - mean_b[:, None]
    residual = np.sqrt(((da - db) ** 2).mean(axis=1))
    contrast = np.maximum(np.sqrt((da**2).mean(axis=1)), np.sqrt((db**2).mean(axis=1)))
    chroma = (np.abs(cba - cbb).mean(axis=1) + np.abs(cra - crb).mean(axis=1)) / 2
    return np.maximum.reduce([np.abs(mean_a - mean_b) / MEAN_LEVELS, chroma / CHROMA_LEVELS,
                              residual / (RESIDUAL_LEVELS + RESIDUAL_SHARE * contrast)])


def is_lossless(opened: Image.Image, data: bytes) -> bool:
    """Whether the file holds its pixels exactly (the keeper prefers it to any JPEG of the same
    size): PNG, BMP, lossless WebP (a VP8L chunk) and TIFF not compressed as JPEG, in a mode that
    is not a palette (a GIF or palette PNG of a photo has lost colours)."""
    if opened.mode in ("P", "1"):
        return False
    if opened.format == "WEBP":
        return b"VP8L" in data[12:64]  # the first chunk (simple format) or the one after VP8X
    if opened.format == "TIFF":
        return opened.info.get("compression") not in ("jpeg", "tiff_jpeg")
    return opened.format in ("PNG", "BMP")


def _planes(signatures: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(N, 384) uint8 -> luma (N, 256), Cb (N, 64), Cr (N, 64) as float32."""
    s = signatures.reshape(-1, SIGNATURE_BYTES).astype(np.float32)
    luma, chroma = SIG_LUMA * SIG_LUMA, SIG_CHROMA * SIG_CHROMA
    return s[:, :luma], s[:, luma:luma + chroma], s[:, luma + chroma:]


def _mix(value: np.uint64) -> np.uint64:
    """splitmix64's finalizer: spreads a packed colour cell over 64 bits (a key, never a mask)."""
    with np.errstate(over="ignore"):
        z = np.uint64(value) + _FLAT_SEED
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))
