"""Fingerprints on real photos, through the ingest decode (`inspect_image`): the same pixels in any
lossless format give the same fingerprint; re-encodes and resizes share a match key and are
confirmed; edits (mirror, brightness) and different flat or watermarked pictures are not."""

from __future__ import annotations

import io

import numpy as np
import pytest
import skimage
from PIL import Image, ImageDraw, ImageEnhance, ImageFont

from prx_core.image.fingerprint import FLAT_LEVELS, is_lossless, signature_distance
from prx_core.sources.ingest import ImageFacts, inspect_image

PHOTOS = {"astronaut": skimage.data.astronaut(), "coffee": skimage.data.coffee(), "rocket": skimage.data.rocket(),
          "motorcycle": skimage.data.stereo_motorcycle()[0]}


def encoded(image: Image.Image, fmt: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def facts(data: bytes) -> ImageFacts:
    found = inspect_image(data)
    assert isinstance(found, ImageFacts), found
    return found


def distance(a: ImageFacts, b: ImageFacts) -> float:
    return float(signature_distance(np.frombuffer(a.signature, np.uint8)[None], np.frombuffer(b.signature, np.uint8)[None])[0])


def same_picture(a: ImageFacts, b: ImageFacts) -> bool:
    """What `duplicates` concludes of two rows: a shared key proposes, the signatures confirm."""
    return bool(set(a.match_keys) & set(b.match_keys)) and distance(a, b) <= 1


@pytest.mark.parametrize("name", sorted(PHOTOS))
def test_the_same_pixels_in_any_lossless_format_have_one_fingerprint(name: str) -> None:
    image = Image.fromarray(PHOTOS[name]).convert("RGB")
    png, webp, bmp = (facts(encoded(image, fmt, **o)) for fmt, o in (("PNG", {}), ("WEBP", {"lossless": True}),
                                                                    ("BMP", {})))
    assert (png.phash, png.match_keys, png.signature) == (webp.phash, webp.match_keys, webp.signature) == (
        bmp.phash, bmp.match_keys, bmp.signature)
    assert png.lossless and webp.lossless and bmp.lossless and png.phash in png.match_keys


@pytest.mark.parametrize("name", sorted(PHOTOS))
@pytest.mark.parametrize("copy", ["jpeg_q75", "jpeg_q95", "webp_q90", "resize_75", "resize_50_q75", "png_of_jpeg"])
def test_copies_share_a_key_and_are_confirmed(name: str, copy: str) -> None:
    image = Image.fromarray(PHOTOS[name]).convert("RGB")
    original = encoded(image, "JPEG", quality=95)
    pixels = Image.open(io.BytesIO(original)).convert("RGB")
    half = pixels.resize((pixels.width // 2, pixels.height // 2), Image.Resampling.LANCZOS)
    data = {"jpeg_q75": lambda: encoded(pixels, "JPEG", quality=75), "jpeg_q95": lambda: encoded(pixels, "JPEG", quality=95),
            "webp_q90": lambda: encoded(pixels, "WEBP", quality=90),
            "resize_75": lambda: encoded(pixels.resize((pixels.width * 3 // 4, pixels.height * 3 // 4),
                                                       Image.Resampling.LANCZOS), "JPEG", quality=90),
            "resize_50_q75": lambda: encoded(half, "JPEG", quality=75), "png_of_jpeg": lambda: encoded(pixels, "PNG")}[copy]()
    assert same_picture(facts(original), facts(data))


@pytest.mark.parametrize("name", sorted(PHOTOS))
def test_a_mirror_image_or_a_brighter_one_is_another_picture(name: str) -> None:
    image = Image.fromarray(PHOTOS[name]).convert("RGB")
    original = facts(encoded(image, "JPEG", quality=95))
    mirror = facts(encoded(image.transpose(Image.Transpose.FLIP_LEFT_RIGHT), "JPEG", quality=95))
    brighter = facts(encoded(ImageEnhance.Brightness(image).enhance(1.4), "JPEG", quality=95))
    assert distance(original, mirror) > 1 and distance(original, brighter) > 1


def flat(colour: tuple[int, int, int], seed: int = 0, text: str = "") -> Image.Image:
    noise = np.random.default_rng(seed).normal(0, 2.0, (600, 800, 1))
    image = Image.fromarray(np.clip(np.asarray(colour) + noise, 0, 255).astype(np.uint8))
    if text:
        layer = Image.new("RGBA", image.size, (0, 0, 0, 0))
        ImageDraw.Draw(layer).text((80, 260), text, font=ImageFont.load_default(size=64), fill=(255, 255, 255, 120))
        image = Image.alpha_composite(image.convert("RGBA"), layer).convert("RGB")
    return image


def test_flat_pictures_are_keyed_by_colour() -> None:
    blue, blue_again, grey = (facts(encoded(flat(c, s), "JPEG", quality=90))
                              for c, s in (((40, 90, 170), 0), ((40, 90, 170), 1), ((150, 150, 155), 0)))
    assert len(blue.match_keys) >= 8  # colour keys: its ranking is noise
    assert same_picture(blue, blue_again)  # another noise draw of the same colour looks the same
    assert not same_picture(blue, grey)


def test_one_watermark_on_two_flat_colours_is_two_pictures() -> None:
    blue, wood = (facts(encoded(flat(c, text="(c) PRX STOCK"), "JPEG", quality=90))
                  for c in ((40, 90, 170), (120, 70, 30)))
    assert distance(blue, wood) > 1
    copy = facts(encoded(flat((40, 90, 170), text="(c) PRX STOCK").resize((400, 300), Image.Resampling.LANCZOS), "PNG"))
    assert same_picture(blue, copy)


def test_flat_threshold_has_both_kinds_of_key_near_it() -> None:
    assert FLAT_LEVELS > 0
    faint = Image.fromarray((128 + 0.6 * np.sin(np.linspace(0, 6, 800))[None, :, None] * np.ones((600, 1, 3))).astype(
        np.float32).round().astype(np.uint8))
    keys = facts(encoded(faint, "PNG")).match_keys
    assert len(keys) in (8, 15)


@pytest.mark.parametrize("fmt, options, mode, lossless", [
    ("PNG", {}, "RGB", True), ("WEBP", {"lossless": True}, "RGB", True), ("WEBP", {"quality": 90}, "RGB", False),
    ("JPEG", {"quality": 100}, "RGB", False), ("PNG", {}, "P", False), ("GIF", {}, "P", False), ("BMP", {}, "RGB", True),
    ("TIFF", {}, "RGB", True), ("TIFF", {"compression": "jpeg"}, "RGB", False)])
def test_lossless_files(fmt: str, options: dict, mode: str, lossless: bool) -> None:
    image = Image.fromarray(PHOTOS["coffee"]).convert(mode)
    data = encoded(image, fmt, **options)
    assert is_lossless(Image.open(io.BytesIO(data)), data) is lossless
