"""Bucket math against the PRX trainer's rules (docs/architecture.md): tiers, the 13 sizes per tier, boundaries, crops."""

from __future__ import annotations

import math

import pytest

from prx_core.image.buckets import (
    ASPECT_RATIO,
    BELOW_FLOOR,
    TIERS,
    Bucket,
    Drop,
    assign_bucket,
    assign_tier,
    bucket_sizes,
    crop_box,
)

# Patch grids (w, h) of a 16x16 budget, derived by hand from the PRX enumeration.
GRIDS = [(11, 22), (12, 21), (12, 20), (13, 19), (14, 18), (15, 17), (16, 16),
         (17, 15), (18, 14), (19, 13), (20, 12), (21, 12), (22, 11)]


@pytest.mark.parametrize("tier", TIERS)
def test_bucket_sizes(tier: int) -> None:
    sizes = bucket_sizes(tier)
    patch = tier // 16
    assert sorted(sizes) == sorted((w * patch, h * patch) for w, h in GRIDS)
    assert len(sizes) == len(set(sizes)) == 13
    for w, h in sizes:
        assert w % 16 == 0 and h % 16 == 0
        assert 0.5 <= w / h <= 2.0
        assert (w // patch) * (h // patch) <= 256
    assert (tier, tier) in sizes
    assert [w / h for w, h in sizes] == sorted(w / h for w, h in sizes)


def test_unknown_tier() -> None:
    with pytest.raises(ValueError, match="unknown tier"):
        bucket_sizes(768)


@pytest.mark.parametrize("tier", TIERS)
def test_tier_boundary_is_exact(tier: int) -> None:
    side = tier * 3 // 4  # sqrt(W*H) exactly 0.75*T
    assert assign_tier(side, side) == tier
    below = assign_tier(side - 1, side)
    assert below == (None if tier == 512 else TIERS[TIERS.index(tier) - 1])
    # a non-square image exactly on the boundary: 16*W*H == 9*T^2
    w, h = side * 2, side // 2
    assert 16 * w * h == 9 * tier * tier and assign_tier(w, h) == tier


@pytest.mark.parametrize(
    ("size", "expected"),
    [((384, 384), 512), ((383, 384), None), ((10000, 10000), 4096), ((767, 768), 512), ((1536, 1536), 2048)],
)
def test_assign_tier(size: tuple[int, int], expected: int | None) -> None:
    assert assign_tier(*size) == expected


def test_floor() -> None:
    drop = assign_bucket(383, 383)
    assert isinstance(drop, Drop) and drop.reason == BELOW_FLOOR and "384x384" in drop.message
    assert isinstance(assign_bucket(384, 384), Bucket)
    assert assign_bucket(0, 500).reason == BELOW_FLOOR
    assert assign_bucket(100, 10).reason == BELOW_FLOOR  # both reasons: the floor is reported


@pytest.mark.parametrize(
    ("size", "ok"),
    [((1600, 800), True), ((1601, 800), False), ((800, 1600), True), ((800, 1601), False),
     ((2000, 999), False), ((999, 2000), False)],
)
def test_aspect_ratio_boundaries(size: tuple[int, int], ok: bool) -> None:
    result = assign_bucket(*size)
    if ok:
        assert isinstance(result, Bucket)
        assert result.aspect == pytest.approx(size[0] / size[1])  # 2.0 and 0.5 have exact buckets
    else:
        assert isinstance(result, Drop) and result.reason == ASPECT_RATIO


@pytest.mark.parametrize("aspect", [0.5, 0.57, 0.66, 0.75, 0.9, 1.0, 1.1, 1.33, 1.5, 1.78, 1.95, 2.0])
@pytest.mark.parametrize("tier", TIERS)
def test_closest_bucket(aspect: float, tier: int) -> None:
    h = math.ceil(tier / math.sqrt(aspect))
    w = math.ceil(h * aspect)
    bucket = assign_bucket(w, h)
    assert isinstance(bucket, Bucket) and bucket.tier == tier
    best = min(abs(bw / bh - w / h) for bw, bh in bucket_sizes(tier))
    assert abs(bucket.aspect - w / h) == pytest.approx(best)
    assert bucket.name == f"{bucket.width}x{bucket.height}"


def test_max_tier_caps_large_images() -> None:
    assert assign_bucket(5120, 2880).tier == 4096
    capped = assign_bucket(5120, 2880, max_tier=1024)
    assert capped.tier == 1024 and capped.size in bucket_sizes(1024)
    assert assign_bucket(383, 383, max_tier=1024).reason == BELOW_FLOOR
    with pytest.raises(ValueError):
        assign_bucket(1000, 1000, max_tier=999)


@pytest.mark.parametrize("size", [(1000, 1000), (1920, 1080), (1080, 1920), (1601, 999), (4000, 2999), (384, 768)])
def test_crop_box_is_minimal_and_centred(size: tuple[int, int]) -> None:
    w, h = size
    bucket = assign_bucket(w, h)
    left, top, right, bottom = crop_box(w, h, bucket)
    cw, ch = right - left, bottom - top
    assert (cw == w) or (ch == h)  # only one dimension is cut
    assert abs(cw / ch - bucket.aspect) <= bucket.aspect / min(cw, ch) + 1e-9  # within a pixel
    assert abs(left - (w - right)) <= 1 and abs(top - (h - bottom)) <= 1  # centred
