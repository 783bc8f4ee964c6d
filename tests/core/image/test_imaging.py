"""The one-decode transform: exact bucket sizes, q92 bytes, pHash from the same decode."""

from __future__ import annotations

import hashlib
import io

import pytest
from PIL import Image

from prx_core.demo import load_manifest
from prx_core.demo import synthetic as syn
from prx_core.demo.photos import skimage_data_dir
from prx_core.image.buckets import Bucket, assign_bucket, bucket_sizes
from prx_core.image.decode import Rejection, decode_image
from prx_core.image.imaging import Processed, draft_target, encode_jpeg, process_image, resize_to_bucket
from prx_core.image.jpeg_quality import estimate_jpeg_quality
from prx_core.image.phash import hamming, phash


@pytest.fixture(scope="module")
def photo() -> Image.Image:
    with Image.open(skimage_data_dir() / "coffee.png") as im:
        return im.convert("RGB")


def test_every_demo_sample_is_processed_or_rejected_as_planted(demo_dir, demo_files) -> None:
    manifest = load_manifest(demo_dir)
    for s in manifest.samples:
        result = process_image(demo_files[(s.source, s.key)][0])
        if s.reject:
            assert isinstance(result, Rejection) and result.reason == s.reject, (s, result)
            continue
        assert isinstance(result, Processed), (s, result)
        expected = assign_bucket(*s.size)
        assert result.bucket == expected and result.original_size == tuple(s.size)
        with Image.open(io.BytesIO(result.jpeg)) as out:
            assert out.format == "JPEG" and out.mode == "RGB" and out.size == expected.size
        assert estimate_jpeg_quality(result.jpeg) == 92
        assert 0 <= result.phash < 2**64


@pytest.mark.parametrize(
    "size", [(384, 384), (640, 480), (1000, 1000), (1920, 1080), (1080, 1920), (1601, 801), (2560, 1600), (3000, 1500)]
)
def test_exact_output_size(photo: Image.Image, size: tuple[int, int]) -> None:
    result = process_image(syn.encode(photo.resize(size), "JPEG", quality=90))
    bucket = assign_bucket(*size)
    assert result.bucket == bucket and bucket.size in bucket_sizes(bucket.tier)
    assert Image.open(io.BytesIO(result.jpeg)).size == bucket.size


def test_bytes_identical_to_the_reference_encode(photo: Image.Image) -> None:
    """Same bytes as decode -> crop+Lanczos -> q92 done step by step: the MDS writer must store these."""
    data = syn.encode(photo.resize((1700, 1100)), "JPEG", quality=88)
    result = process_image(data)
    decoded = decode_image(data, min_size=draft_target((1700, 1100), result.bucket))
    reference = encode_jpeg(resize_to_bucket(decoded.image, result.bucket))
    assert hashlib.sha256(result.jpeg).digest() == hashlib.sha256(reference).digest()
    assert process_image(data).jpeg == result.jpeg  # deterministic


@pytest.mark.parametrize("size,fmt", [((1700, 1100), "JPEG"), ((800, 1200), "PNG"), ((3600, 2400), "JPEG")])
def test_without_facts_the_same_image_is_rendered_and_nothing_else_computed(
        photo: Image.Image, size: tuple[int, int], fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """mds_shards' path: the pHash and source quality ingest stored are not computed again (they
    would raise here), and the stored bytes, bucket and sizes are those of the full transform."""
    data = syn.encode(photo.resize(size), fmt, quality=90) if fmt == "JPEG" else syn.encode(photo.resize(size), fmt)
    full = process_image(data, max_tier=1024)

    def never(*_args: object) -> None:
        raise AssertionError("computed on the render path")

    monkeypatch.setattr("prx_core.image.imaging.phash", never)
    monkeypatch.setattr("prx_core.image.imaging.estimate_jpeg_quality", never)
    rendered = process_image(data, max_tier=1024, facts=False)
    assert isinstance(rendered, Processed), rendered
    assert (rendered.jpeg, rendered.bucket, rendered.original_size) == (full.jpeg, full.bucket, full.original_size)
    assert rendered.phash is None and rendered.source_quality is None
    assert isinstance(process_image(data), Rejection)  # the full path does call them


def test_draft_used_when_the_tier_is_capped(photo: Image.Image) -> None:
    data = syn.encode(photo.resize((3600, 2400)), "JPEG", quality=90)
    full = process_image(data)
    capped = process_image(data, max_tier=1024)
    assert full.bucket.tier == 2048 and full.draft_scale == 1
    assert capped.bucket.tier == 1024 and capped.draft_scale == 2
    assert Image.open(io.BytesIO(capped.jpeg)).size == capped.bucket.size
    # the hash does not care which scale the decode ran at
    assert hamming(full.phash, capped.phash) <= 2


def test_phash_is_of_the_whole_upright_picture(photo: Image.Image) -> None:
    big = photo.resize((1500, 1000))
    result = process_image(syn.encode(big, "PNG"))
    assert hamming(result.phash, phash(big)) <= 2
    rotated = process_image(syn.exif_rotated_jpeg(big, 6, quality=95))
    assert rotated.orientation == 6 and rotated.original_size == (1500, 1000)
    assert hamming(rotated.phash, result.phash) <= 4


def test_source_facts(photo: Image.Image) -> None:
    jpeg = process_image(syn.encode(photo.resize((800, 600)), "JPEG", quality=75))
    png = process_image(syn.rgba_png(photo.resize((800, 600))))
    assert (jpeg.source_format, jpeg.source_quality, jpeg.source_mode) == ("JPEG", 75, "RGB")
    assert (png.source_format, png.source_quality, png.source_mode) == ("PNG", None, "RGBA")


def test_crop_is_centred(photo: Image.Image) -> None:
    """A wide image with distinct left / centre / right thirds keeps its centre."""
    im = Image.new("RGB", (1800, 1000), (255, 0, 0))
    im.paste((0, 255, 0), (300, 0, 1500, 1000))
    im.paste((0, 0, 255), (1500, 0, 1800, 1000))
    result = process_image(syn.encode(im, "PNG"))
    out = Image.open(io.BytesIO(result.jpeg)).convert("RGB")
    assert result.bucket.aspect < 1.8
    g = out.getpixel((out.width // 2, out.height // 2))
    assert g[1] > 200 and g[0] < 40
    left, right = out.getpixel((2, out.height // 2)), out.getpixel((out.width - 3, out.height // 2))
    assert left[0] > 150 and right[2] > 150  # both edges cut by the same amount


def test_rejections_never_raise() -> None:
    assert process_image(b"").reason == "empty"
    assert process_image(b"garbage" * 10).reason == "not_an_image"
    small = syn.encode(Image.new("RGB", (300, 300)), "PNG")
    assert process_image(small).reason == "below_floor"
    wide = syn.encode(Image.new("RGB", (2000, 500)), "PNG")
    assert process_image(wide).reason == "aspect_ratio"
    with pytest.raises(ValueError):  # a configuration error is not a property of the image
        process_image(small, max_tier=300)


def test_bucket_type() -> None:
    assert isinstance(assign_bucket(1000, 1000), Bucket)
