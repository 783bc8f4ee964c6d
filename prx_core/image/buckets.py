"""Resolution tiers and aspect-ratio buckets, exactly as the PRX trainer enumerates them.

Within a tier every bucket has (about) the same patch budget, 16x16 patches of T/16 pixels, so
per-stream batches cost the same whatever the aspect ratio. Bucketing is a pure function of the
(upright) image size: it runs on a header read, before any pixel is decoded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import numpy as np

TIERS: tuple[int, ...] = (512, 1024, 2048, 4096)
PATCHES_PER_SIDE = 16  # default_image_size / patch_size_pixels
PATCH_BUDGET = PATCHES_PER_SIDE * PATCHES_PER_SIDE
MIN_ASPECT, MAX_ASPECT = 0.5, 2.0
MAX_UPSCALE = 4 / 3  # a tier accepts an image upscaled by at most this in each side
FLOOR_SIDE = round(TIERS[0] / MAX_UPSCALE)  # 384: sqrt(W*H) below this is unusable
FLOOR_PIXELS = FLOOR_SIDE * FLOOR_SIDE  # 147,456

BELOW_FLOOR = "below_floor"
ASPECT_RATIO = "aspect_ratio"


@dataclass(frozen=True)
class Bucket:
    """Where an image goes: a tier and an exact (width, height) in pixels."""

    tier: int
    width: int
    height: int

    @property
    def size(self) -> tuple[int, int]:
        return (self.width, self.height)

    @property
    def aspect(self) -> float:
        return self.width / self.height

    @property
    def name(self) -> str:
        """The stream folder name in the MDS tree: `<w>x<h>`."""
        return f"{self.width}x{self.height}"


@dataclass(frozen=True)
class Drop:
    """Why an image cannot be bucketed: a stable reason code and a short message."""

    reason: str
    message: str


@cache
def _grid_sizes() -> tuple[tuple[int, int], ...]:
    """The 13 patch grids (w, h): tallest height per width, then widest width per height."""
    lo = math.ceil(math.sqrt(PATCH_BUDGET * MIN_ASPECT))
    hi = math.floor(math.sqrt(PATCH_BUDGET * MAX_ASPECT))
    grids = {(w, PATCH_BUDGET // w) for w in range(lo, hi + 1)}
    grids |= {(PATCH_BUDGET // h, h) for h in range(lo, hi + 1)}
    inside = {(w, h) for w, h in grids if MIN_ASPECT <= w / h <= MAX_ASPECT}
    return tuple(sorted(inside, key=lambda g: (g[0] / g[1], g[0])))


def bucket_sizes(tier: int) -> list[tuple[int, int]]:
    """The (width, height) pixel sizes of `tier`, ordered by aspect ratio (portrait first)."""
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier}; tiers are {TIERS}")
    patch = tier // PATCHES_PER_SIDE
    return [(w * patch, h * patch) for w, h in _grid_sizes()]


def assign_tier(width: int, height: int, max_tier: int = TIERS[-1]) -> int | None:
    """The largest tier T <= `max_tier` with sqrt(W*H) >= 0.75*T, or None below the floor.

    Compared in integers (16*W*H >= 9*T^2) so that the boundary is exact. `max_tier` lets a
    corpus for one training stage (say 1024) send larger images to that tier, downscaled.
    """
    area = width * height
    qualifying = [t for t in TIERS if t <= max_tier and 16 * area >= 9 * t * t]
    return max(qualifying) if qualifying else None


def assign_bucket(width: int, height: int, max_tier: int = TIERS[-1]) -> Bucket | Drop:
    """The bucket of an upright image of `width` x `height`, or why it is dropped.

    The floor is checked first: an image both too small and too elongated reports `below_floor`.
    Within the tier the bucket with the closest w/h wins (ties: the first in `bucket_sizes`).
    """
    if max_tier not in TIERS:
        raise ValueError(f"unknown max_tier {max_tier}; tiers are {TIERS}")
    if width <= 0 or height <= 0:
        return Drop(BELOW_FLOOR, f"invalid size {width}x{height}")
    tier = assign_tier(width, height, max_tier)
    if tier is None:
        return Drop(BELOW_FLOOR, f"{width}x{height} is below the {FLOOR_SIDE}x{FLOOR_SIDE} pixel floor")
    # w/h in [0.5, 2] compared exactly in integers
    if 2 * width < height or width > 2 * height:
        return Drop(ASPECT_RATIO, f"aspect ratio {width / height:.3f} is outside [{MIN_ASPECT}, {MAX_ASPECT}]")
    aspect = width / height
    w, h = min(bucket_sizes(tier), key=lambda s: abs(s[0] / s[1] - aspect))
    return Bucket(tier, w, h)


def crop_box(width: int, height: int, bucket: Bucket) -> tuple[int, int, int, int]:
    """The centred minimal crop of a `width` x `height` image to the bucket's aspect ratio.

    Returns (left, top, right, bottom). Only one dimension is cut; rounding keeps the crop
    within one pixel of the exact ratio.
    """
    if width * bucket.height > height * bucket.width:  # too wide: cut the sides
        new_w = max(1, round(height * bucket.width / bucket.height))
        left = (width - new_w) // 2
        return (left, 0, left + new_w, height)
    new_h = max(1, round(width * bucket.height / bucket.width))
    top = (height - new_h) // 2
    return (0, top, width, top + new_h)


def assign_buckets(widths: np.ndarray, heights: np.ndarray, max_tier: int = TIERS[-1]) -> list[Bucket | Drop]:
    """`assign_bucket` for many sizes at once: computed once per distinct size (a web corpus
    repeats a few thousand sizes), so a million rows cost a million lookups, not decisions."""
    keys = (np.asarray(widths, np.int64) << 32) | np.asarray(heights, np.int64)
    distinct, inverse = np.unique(keys, return_inverse=True)
    decided = [assign_bucket(int(k >> 32), int(k & 0xFFFFFFFF), max_tier) for k in distinct.tolist()]
    return [decided[i] for i in inverse.tolist()]
