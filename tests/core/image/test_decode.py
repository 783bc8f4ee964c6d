"""Safe decoding on real and hostile files: allow-list, pixel cap, truncation, EXIF, modes."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
from PIL import Image, ImageFile

from prx_core.demo import load_manifest
from prx_core.demo import synthetic as syn
from prx_core.demo.photos import skimage_data_dir
from prx_core.image.decode import (
    ALLOWED_FORMATS,
    Decoded,
    Rejection,
    decode_image,
    open_image,
    sniff_refused_format,
    to_rgb,
)


def encode(image: Image.Image, fmt: str, **params: object) -> bytes:
    return syn.encode(image, fmt, **params)


@pytest.fixture(scope="module")
def photo() -> Image.Image:
    with Image.open(skimage_data_dir() / "astronaut.png") as im:
        return im.convert("RGB")


def test_planted_hostile_files_are_rejected_with_their_reason(demo_dir, demo_files) -> None:
    manifest = load_manifest(demo_dir)
    decode_rejects = {"empty", "not_an_image", "too_many_pixels", "format_not_allowed", "truncated"}
    checked = 0
    for s in manifest.samples:
        result = decode_image(demo_files[(s.source, s.key)][0])
        if s.reject in decode_rejects:
            assert isinstance(result, Rejection) and result.reason == s.reject, (s, result)
            assert result.message
            checked += 1
        else:  # everything else decodes, whatever its mode or container
            assert isinstance(result, Decoded), (s, result)
            assert result.image.mode == "RGB" and result.image.size == result.original_size == tuple(s.size)
            assert result.format == s.format
    assert checked >= 7


@pytest.mark.parametrize("fmt", ALLOWED_FORMATS)
def test_allowed_formats_decode(photo: Image.Image, fmt: str) -> None:
    params = {"compression": "tiff_lzw"} if fmt == "TIFF" else {}
    source = photo.convert("P") if fmt == "GIF" else photo
    result = decode_image(encode(source, fmt, **params))
    assert isinstance(result, Decoded) and result.format == fmt and result.image.size == photo.size


@pytest.mark.parametrize(
    ("data", "reason", "named"),
    [
        (b"", "empty", None),
        (b"<!DOCTYPE html><html>404</html>", "not_an_image", None),
        (b"P6\n2 2\n255\n" + bytes(12), "format_not_allowed", "PPM"),
        (b"8BPS\x00\x01" + bytes(40), "format_not_allowed", "PSD"),
        (b"%PDF-1.7\n" + bytes(40), "format_not_allowed", "PDF"),
        (b"<svg xmlns='http://www.w3.org/2000/svg'/>", "format_not_allowed", "SVG"),
        (b"\x00\x00\x00\x1cftypavif" + bytes(40), "format_not_allowed", "HEIF/AVIF"),
        (bytes(range(256)) * 4, "not_an_image", None),
    ],
)
def test_refused_inputs(data: bytes, reason: str, named: str | None) -> None:
    result = decode_image(data)
    assert isinstance(result, Rejection) and result.reason == reason
    if named:
        assert named in result.message and sniff_refused_format(data) == named


def test_real_ppm_and_ico_are_refused_without_their_plugin(photo: Image.Image) -> None:
    for fmt, name in (("PPM", "PPM"), ("ICO", "ICO")):
        result = decode_image(encode(photo.resize((64, 64)), fmt))
        assert isinstance(result, Rejection) and result.reason == "format_not_allowed" and name in result.message


def test_pixel_cap_is_checked_from_the_header(photo: Image.Image) -> None:
    # The bomb's pixel data is a few bytes: decoding would fail as truncated, so a
    # too_many_pixels answer proves nothing was decoded.
    assert decode_image(syn.pixel_bomb_png(12000, 9000)).reason == "too_many_pixels"  # 108 MP > 100 MP cap
    assert decode_image(syn.pixel_bomb_png(20000, 20000)).reason == "too_many_pixels"  # Pillow's own bomb error
    data = encode(photo, "PNG")
    assert decode_image(data, max_pixels=512 * 512 - 1).reason == "too_many_pixels"
    assert isinstance(decode_image(data, max_pixels=512 * 512), Decoded)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
@pytest.mark.parametrize("keep", [0.3, 0.9])
def test_truncated_data_is_never_loaded(photo: Image.Image, fmt: str, keep: float) -> None:
    data = encode(photo, fmt)
    result = decode_image(data[: int(len(data) * keep)])
    assert isinstance(result, Rejection) and result.reason in ("truncated", "decode_error"), result
    if fmt != "WEBP":
        assert result.reason == "truncated"


def test_global_load_truncated_flag_does_not_let_padding_through(photo: Image.Image, monkeypatch) -> None:
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    data = encode(photo, "JPEG")
    assert isinstance(decode_image(data[: len(data) // 2]), Rejection)


def asymmetric(size: tuple[int, int] = (300, 200)) -> Image.Image:
    """Red block in the top-left corner, blue elsewhere: orientation is visible."""
    im = Image.new("RGB", size, (0, 0, 255))
    im.paste((255, 0, 0), (0, 0, size[0] // 3, size[1] // 3))
    return im


INVERSE = {
    1: None, 2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_90, 7: Image.Transpose.TRANSVERSE, 8: Image.Transpose.ROTATE_270,
}


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_applied(orientation: int) -> None:
    upright = asymmetric()
    stored = upright if INVERSE[orientation] is None else upright.transpose(INVERSE[orientation])
    exif = Image.Exif()
    exif[0x0112] = orientation
    result = decode_image(encode(stored, "JPEG", quality=95, exif=exif.tobytes()))
    assert isinstance(result, Decoded) and result.orientation == orientation
    assert result.image.size == result.original_size == upright.size
    r, g, b = result.image.getpixel((10, 10))
    assert r > 200 and b < 60  # the red corner is top-left again
    r, g, b = result.image.getpixel((290, 190))
    assert b > 200 and r < 60


def solid(mode: str, value: object, size: tuple[int, int] = (40, 30)) -> Image.Image:
    return Image.new(mode, size, value)


@pytest.mark.parametrize(
    ("image", "expected"),
    [
        (solid("RGBA", (255, 0, 0, 0)), (255, 255, 255)),  # transparent red -> white
        (solid("RGBA", (255, 0, 0, 255)), (255, 0, 0)),
        (solid("RGBA", (0, 0, 0, 128)), (127, 127, 127)),  # half black over white
        (solid("LA", (0, 0)), (255, 255, 255)),
        (solid("LA", (10, 255)), (10, 10, 10)),
        (solid("L", 77), (77, 77, 77)),
        (solid("1", 1), (255, 255, 255)),
        (Image.fromarray(np.full((30, 40), 65535, np.uint16)), (255, 255, 255)),  # I;16
        (Image.fromarray(np.full((30, 40), 32896, np.uint16)), (128, 128, 128)),
        (Image.fromarray(np.full((30, 40), 200, np.int32)), (200, 200, 200)),  # I, 8-bit range kept
        (Image.fromarray(np.full((30, 40), 65535, np.int32)), (255, 255, 255)),  # I, 16-bit range scaled
        (Image.fromarray(np.full((30, 40), 0.5, np.float32)), (128, 128, 128)),  # F in [0, 1]
        (solid("CMYK", (0, 0, 0, 0)), (255, 255, 255)),
        (solid("YCbCr", (255, 128, 128)), (255, 255, 255)),
    ],
    ids=lambda v: getattr(v, "mode", None) or str(v),
)
def test_to_rgb_modes(image: Image.Image, expected: tuple[int, int, int]) -> None:
    rgb = to_rgb(image)
    assert rgb.mode == "RGB" and rgb.size == image.size
    assert all(abs(a - b) <= 1 for a, b in zip(rgb.getpixel((5, 5)), expected)), rgb.getpixel((5, 5))


def test_palette_transparency_composited_over_white() -> None:
    im = Image.new("P", (20, 20), 0)
    im.putpalette([255, 0, 0] + [0, 255, 0] * 255)
    im.paste(1, (10, 0, 20, 20))
    result = decode_image(encode(im, "PNG", transparency=0))
    assert result.image.getpixel((2, 2)) == (255, 255, 255) and result.image.getpixel((15, 2)) == (0, 255, 0)


def test_cmyk_uses_embedded_icc_profile() -> None:
    profile = syn.cmyk_profile_path()
    assert profile, "scripts/setup.sh installs libgs-common, which ships CMYK ICC profiles"
    original = (200, 30, 30)
    data = syn.cmyk_icc_jpeg(Image.new("RGB", (64, 64), original), profile, quality=100)
    managed = decode_image(data).image.getpixel((32, 32))
    naive = Image.open(io.BytesIO(data)).convert("RGB").getpixel((32, 32))
    error = lambda px: sum((a - b) ** 2 for a, b in zip(px, original))  # noqa: E731
    assert error(managed) < error(naive)  # the profile round-trips closer than Pillow's formula


def test_gif_and_tiff_first_frame() -> None:
    frames = [Image.new("P", (400, 400), i) for i in (1, 2)]
    for f in frames:
        f.putpalette([0, 0, 0, 255, 0, 0, 0, 255, 0] + [0] * 759)
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    assert decode_image(buf.getvalue()).image.getpixel((5, 5)) == (255, 0, 0)
    pages = [Image.new("RGB", (400, 400), c) for c in ((0, 0, 255), (0, 255, 0))]
    buf = io.BytesIO()
    pages[0].save(buf, "TIFF", save_all=True, append_images=pages[1:])
    assert decode_image(buf.getvalue()).image.getpixel((5, 5)) == (0, 0, 255)
    # a float RGB TIFF Pillow cannot read: an allowed container, so a decode_error, not "not an image"
    float_tiff = (skimage_data_dir() / "multipage_rgb.tif").read_bytes()
    assert decode_image(float_tiff).reason == "decode_error"


def test_draft_decodes_jpeg_at_a_smaller_scale(photo: Image.Image) -> None:
    big = photo.resize((2048, 2048))
    data = encode(big, "JPEG", quality=90)
    result = decode_image(data, min_size=(500, 500))
    assert result.draft_scale == 4 and result.image.size == (512, 512) and result.original_size == (2048, 2048)
    assert decode_image(data, min_size=(513, 513)).draft_scale == 2


def test_mutated_files_never_raise(photo: Image.Image) -> None:
    rng = random.Random(7)
    sources = [encode(photo.resize((256, 256)), fmt) for fmt in ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")]
    reasons = set()
    for i in range(240):
        data = bytearray(sources[i % len(sources)])
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        result = decode_image(bytes(data))  # must return, never raise
        assert isinstance(result, (Decoded, Rejection))
        if isinstance(result, Rejection):
            reasons.add(result.reason)
    assert reasons <= {"truncated", "corrupt_image", "decode_error", "not_an_image", "too_many_pixels",
                       "format_not_allowed"}


def test_open_image_reads_only_the_header(photo: Image.Image) -> None:
    opened = open_image(encode(photo, "JPEG"))
    assert opened.size == photo.size and opened.format == "JPEG"
    assert opened.tile  # tiles still pending: load() clears them, so nothing was decoded yet
