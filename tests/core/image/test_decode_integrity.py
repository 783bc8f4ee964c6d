"""Corrupt and cut data is a reject, never filler pixels, on every decode path (header-only open
then decode, DCT-scaled ingest, `process_image`), and deep images decode in bounded memory.
Real photos (scikit-image) with their bytes damaged here."""

from __future__ import annotations

import io
import struct
import tracemalloc
import zlib

import numpy as np
import pytest
import skimage
from PIL import Image, ImageFile

from prx_core.demo.photos import skimage_data_dir
from prx_core.image.decode import Decoded, Rejection, decode_image
from prx_core.image.imaging import process_image
from prx_core.sources.ingest import inspect_image


@pytest.fixture(scope="module")
def photo() -> Image.Image:
    with Image.open(skimage_data_dir() / "astronaut.png") as im:
        return im.convert("RGB")


def encode(image: Image.Image, fmt: str, **params: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **params)
    return buffer.getvalue()


def reasons(data: bytes) -> set[str]:
    """The outcome of every decode path: a reason, or `decoded`."""
    results = (decode_image(data), decode_image(data, min_size=(64, 64)), process_image(data), inspect_image(data))
    return {r.reason if isinstance(r, Rejection) else "decoded" for r in results}


def chunks(png: bytes) -> list[tuple[int, bytes, int]]:
    """(offset, type, data length) of every PNG chunk."""
    out, pos = [], 8
    while pos < len(png):
        length, kind = struct.unpack_from(">I4s", png, pos)
        out.append((pos, kind, length))
        pos += 12 + length
    return out


def png_with_idat(png: bytes, idat: bytes) -> bytes:
    """`png` with its image data replaced by one IDAT chunk holding `idat` (valid CRC)."""
    head = png[: next(pos for pos, kind, _ in chunks(png) if kind == b"IDAT")]
    body = b"IDAT" + idat
    return head + struct.pack(">I", len(idat)) + body + struct.pack(">I", zlib.crc32(body)) + png[-12:]


@pytest.mark.parametrize("where", [0.1, 0.5, 0.9])
def test_png_with_damaged_image_data_is_corrupt(photo: Image.Image, where: float) -> None:
    data = bytearray(encode(photo, "PNG"))
    start = int(len(data) * where)
    data[start : start + 32] = bytes(32)  # a zeroed run inside an IDAT chunk
    assert reasons(bytes(data)) == {"corrupt_image"}


def test_png_image_data_that_checks_its_crc_but_not_its_stream_is_corrupt(photo: Image.Image) -> None:
    png = encode(photo, "PNG")
    raw = zlib.decompress(b"".join(png[pos + 8 : pos + 8 + n] for pos, kind, n in chunks(png) if kind == b"IDAT"))
    assert reasons(png_with_idat(png, bytes(4096))) == {"corrupt_image"}  # decoded flat, pHash 0, before
    assert reasons(png_with_idat(png, zlib.compress(raw[: len(raw) // 2]))) == {"corrupt_image"}  # half the rows
    assert reasons(png_with_idat(png, zlib.compress(raw)[:-4])) == {"corrupt_image"}  # no Adler-32
    assert reasons(png_with_idat(png, zlib.compress(raw))) == {"decoded"}


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "WEBP-lossless", "TIFF", "GIF", "BMP"])
@pytest.mark.parametrize("keep", [0.5, 0.97])
def test_cut_files_are_truncated_on_every_path(photo: Image.Image, fmt: str, keep: float) -> None:
    source = photo.convert("P") if fmt == "GIF" else photo
    data = encode(source, fmt.split("-")[0], lossless=fmt.endswith("lossless")) if fmt.startswith("WEBP") \
        else encode(source, fmt)
    assert reasons(data) == {"decoded"}
    assert reasons(data[: int(len(data) * keep)]) == {"truncated"}


def test_cut_files_stay_refused_with_pillows_lenient_flag(photo: Image.Image, monkeypatch) -> None:
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    for fmt in ("JPEG", "PNG", "WEBP"):
        data = encode(photo, fmt)
        assert "decoded" not in reasons(data[: int(len(data) * 0.9)]), fmt


def test_progressive_jpeg_cut_after_its_first_scans_is_truncated(photo: Image.Image) -> None:
    data = encode(photo, "JPEG", quality=90, progressive=True)
    assert reasons(data[: len(data) // 3]) == {"truncated"}  # the first scans alone: a blurry full image


def test_deflate_tiff_with_a_damaged_strip_is_corrupt(photo: Image.Image) -> None:
    data = bytearray(encode(photo, "TIFF", compression="tiff_adobe_deflate"))
    start = len(data) // 2
    data[start : start + 16] = bytes(16)
    assert reasons(bytes(data)) == {"corrupt_image"}


def test_deep_images_decode_to_their_values() -> None:
    camera = skimage.data.camera()  # 512x512 8-bit grey
    sixteen = encode(Image.fromarray(camera.astype(np.uint16) * 257), "PNG")
    float_tiff = encode(Image.fromarray(camera.astype(np.float32) / 255), "TIFF")
    int_tiff = encode(Image.fromarray(camera.astype(np.int32) * 257), "TIFF")
    for data, mode in ((sixteen, "I;16"), (float_tiff, "F"), (int_tiff, "I")):
        result = decode_image(data)
        assert isinstance(result, Decoded) and result.mode == mode, (mode, result)
        grey = np.asarray(result.image)[..., 0].astype(int)
        assert np.abs(grey - camera).max() <= 1, mode


def test_float_image_with_nan_and_infinity_decodes() -> None:
    values = np.full((64, 96), 0.5, np.float32)
    values[0, :3] = (np.nan, np.inf, -np.inf)
    result = decode_image(encode(Image.fromarray(values), "TIFF"))
    assert isinstance(result, Decoded) and result.image.getpixel((10, 10)) == (128, 128, 128)


@pytest.mark.parametrize("fmt", ["PNG", "TIFF"])
def test_a_large_deep_image_decodes_in_bounded_memory(fmt: str) -> None:
    """A 10 MP 16-bit PNG (or float TIFF) of ~100 KB took 175 MB of float64 copies to convert."""
    height, width = 2500, 4000
    ramp = np.linspace(0, 1, width, dtype=np.float32)[None, :].repeat(height, axis=0)
    image = Image.fromarray((ramp * 65535).astype(np.uint16)) if fmt == "PNG" else Image.fromarray(ramp)
    data = encode(image, fmt, **({"compression": "tiff_adobe_deflate"} if fmt == "TIFF" else {}))
    del image, ramp
    tracemalloc.start()
    try:
        result = decode_image(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert isinstance(result, Decoded) and result.image.size == (width, height)
    assert result.image.getpixel((0, 0))[0] == 0 and result.image.getpixel((width - 1, 0))[0] == 255
    assert peak < 24 << 20, f"{peak / 2**20:.0f} MB traced (8-bit result: {width * height / 2**20:.0f} MB)"
