"""CPU and memory bombs under the pixel cap are refused with their reason, on the ingest path
(`inspect_image`), the mds_shards path (`process_image`) and the plain decode, before the work
they would cost; real progressive JPEGs and interlaced PNGs still decode to the same pixels.
Measured before the guards (a loaded 2-core machine): a 0.12 MiB 16 MP JPEG with 1,000 repeated
scans was accepted after 6-14 s (linear in scans); a 4 MiB zlib stream behind a 64x64 PNG or
TIFF header ran 13-20 s before a refusal; a 60 MiB single-IDAT PNG's check held 121 MiB for
1.9 s. The tests assert reasons, what was never called and tracemalloc peaks, not wall-clock times."""

from __future__ import annotations

import io
import tracemalloc
import zlib
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from prx_core.demo.photos import skimage_data_dir
from prx_core.image import budget, imaging
from prx_core.image import decode as decode_module
from prx_core.image.decode import Decoded, Rejection, decode_image
from prx_core.image.imaging import Processed, process_image
from prx_core.image.broken import Broken
from prx_core.image.integrity import Inflater
from prx_core.image.structure import MAX_JPEG_MARKERS, MAX_JPEG_SCANS, MAX_PNG_CHUNKS
from prx_core.sources.ingest import ImageFacts, inspect_image
from image_bombs import (
    deflate_tiff,
    encode_jpeg,
    flat_progressive,
    interlaced_png,
    png_file,
    repeat_last_scan,
    scan_count,
    split,
    zeros_stream,
)


@pytest.fixture(scope="module")
def photo() -> Image.Image:
    with Image.open(skimage_data_dir() / "astronaut.png") as im:
        return im.convert("RGB")


def outcomes(data: bytes) -> set[str]:
    """The reason (or `decoded`) of every decode path: plain, DCT-scaled, ingest, mds_shards."""
    results = (decode_image(data), decode_image(data, min_size=(64, 64)), inspect_image(data), process_image(data))
    return {r.reason if isinstance(r, Rejection) else "decoded" for r in results}


@pytest.fixture()
def no_decoder(monkeypatch):
    """Fail the test if Pillow is asked to open (and so to parse or decode) the bytes."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("Pillow was reached: the bomb was not refused before decoding")
    monkeypatch.setattr(Image, "open", refuse)


def test_progressive_jpeg_with_its_last_scan_repeated_is_refused_before_decoding(no_decoder) -> None:
    bomb = flat_progressive(4000, 3000)  # 16 MP, 0.18 MiB, 3,010 scans: 20-40 s, accepted, before
    assert scan_count(bomb) == 3010 and len(bomb) < 1 << 20
    assert outcomes(bomb) == {"too_many_scans"}
    message = decode_image(bomb).message
    assert f"more than {MAX_JPEG_SCANS} scans" in message


def test_scan_limit_is_exact() -> None:
    base = encode_jpeg(Image.new("RGB", (1024, 1024), (9, 99, 199)), progressive=True)
    at_limit = repeat_last_scan(base, MAX_JPEG_SCANS - scan_count(base))
    assert scan_count(at_limit) == MAX_JPEG_SCANS and outcomes(at_limit) == {"decoded"}
    assert outcomes(repeat_last_scan(at_limit, 1)) == {"too_many_scans"}


def test_jpeg_of_a_million_empty_segments_is_refused_before_pillow_parses_it(no_decoder) -> None:
    jpeg = encode_jpeg(Image.new("RGB", (64, 64), (1, 2, 3)))
    bomb = jpeg[:2] + b"\xff\xfe\x00\x02" * 1_000_000 + jpeg[2:]  # 4 MB: 0.7 s and 61 MiB in Pillow before
    assert outcomes(bomb) == {"too_many_segments"}
    assert f"more than {MAX_JPEG_MARKERS} marker segments" in decode_image(bomb).message


@pytest.mark.parametrize("params", [{"progressive": True}, {"progressive": True, "optimize": True},
                                    {"progressive": True, "grey": True}, {"icc_profile": bytes(1 << 20)}])
def test_real_jpegs_decode_as_pillow_decodes_them(photo: Image.Image, params: dict) -> None:
    params = dict(params)
    source = photo.convert("L") if params.pop("grey", False) else photo
    data = encode_jpeg(source, quality=90, **params)  # a 1 MiB ICC profile is 17 APP2 segments
    assert scan_count(data) <= 10
    result = decode_image(data)
    assert isinstance(result, Decoded)
    with Image.open(io.BytesIO(data)) as reference:
        assert np.array_equal(np.asarray(result.image), np.asarray(reference.convert("RGB")))
    assert outcomes(data) == {"decoded"}


def test_png_zlib_bomb_stops_inflating_one_byte_past_its_header(no_decoder) -> None:
    stream = zeros_stream(16)  # inflates ~16 GiB: to the end (~60 s) before it was refused
    expected = 64 * (1 + 64 * 3)
    inflater = Inflater(expected, "PNG image data")
    with pytest.raises(Broken, match="inflates past the 12352 bytes"):
        inflater.feed(stream)
    assert inflater.total == expected + 1


def test_png_zlib_bomb_is_corrupt_on_every_path_in_bounded_memory() -> None:
    bomb = png_file(64, 64, split(zeros_stream(16), 1 << 16))
    tracemalloc.start()
    try:
        assert outcomes(bomb) == {"corrupt_image"}
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20
    assert "inflates past the 12352 bytes its header implies" in decode_image(bomb).message


def test_deflate_tiff_strip_bomb_stops_at_its_strip_size() -> None:
    grey = (np.arange(64 * 64) % 251).astype(np.uint8).reshape(64, 64)
    good = deflate_tiff(64, 64, zlib.compress(grey.tobytes()))
    result = decode_image(good)
    assert isinstance(result, Decoded) and np.array_equal(np.asarray(result.image)[..., 0], grey)
    bomb = deflate_tiff(64, 64, zeros_stream(16))  # ran to the end of the stream before (4 MiB: 15 s)
    assert outcomes(bomb) == {"corrupt_image"}
    assert "inflates past the 4096 bytes" in decode_image(bomb).message


def test_png_of_many_chunks_is_refused_before_pillow_parses_it(no_decoder) -> None:
    image = bytes(64 * (1 + 64 * 3))
    pieces = [zlib.compress(image)] + [b""] * MAX_PNG_CHUNKS  # 1.2 MB; 1M such chunks took 3.6 s and 183 MiB
    assert outcomes(png_file(64, 64, pieces)) == {"too_many_chunks"}


def test_large_single_idat_png_is_checked_in_bounded_memory() -> None:
    pixels = np.random.default_rng(7).integers(0, 256, (2600, 2600, 3), dtype=np.uint8)
    raw = b"".join(b"\x00" + row.tobytes() for row in pixels)
    data = png_file(2600, 2600, [zlib.compress(raw, 1)])  # 19 MiB in one IDAT chunk
    del raw
    tracemalloc.start()
    try:
        result = decode_image(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert isinstance(result, Decoded) and np.array_equal(np.asarray(result.image), pixels)
    assert peak < 4 << 20  # the check copied the unconsumed input each step: ~2x the data before


def test_interlaced_and_chunked_pngs_decode_to_their_pixels(photo: Image.Image) -> None:
    pixels = np.asarray(photo)
    interlaced = interlaced_png(pixels)
    with Image.open(io.BytesIO(interlaced)) as opened:
        assert opened.info.get("interlace") == 1
    for data in (interlaced, png_file(photo.width, photo.height, split(zlib.compress(
            b"".join(b"\x00" + row.tobytes() for row in pixels)), 1024))):
        result = decode_image(data)
        assert isinstance(result, Decoded) and np.array_equal(np.asarray(result.image), pixels)
        assert outcomes(data) == {"decoded"}


def test_a_slow_image_under_every_limit_is_a_decode_timeout() -> None:
    slow = flat_progressive(4000, MAX_JPEG_SCANS - 10)  # 100 scans over 16 MP: about a second of decoding
    assert isinstance(decode_image(slow), Decoded) and isinstance(process_image(slow), Processed)
    for result in (decode_image(slow, budget_s=0.05), process_image(slow, budget_s=0.05)):
        assert isinstance(result, Rejection) and result.reason == "decode_timeout", result
        assert "decode budget of 0.05 s spent" in result.message


class FakeClock:
    """The monotonic clock `prx_core.image.budget` reads, moving only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("slow_stage", ["to_rgb", "resize_to_bucket", "phash", "encode_jpeg"])
def test_the_budget_is_checked_between_stages_on_the_ingest_and_mds_paths(
    photo: Image.Image, monkeypatch, slow_stage: str
) -> None:
    """A stage that takes longer than the budget (the fake clock jumps 60 s inside it) makes the
    sample a `decode_timeout` on the paths that run that stage, whatever the stage."""
    clock = FakeClock()
    monkeypatch.setattr(budget, "time", SimpleNamespace(monotonic=clock))
    module = decode_module if slow_stage == "to_rgb" else imaging
    real = getattr(module, slow_stage)

    def slow(*args: object, **kwargs: object) -> object:
        clock.now += 60
        return real(*args, **kwargs)

    monkeypatch.setattr(module, slow_stage, slow)
    data = encode_jpeg(photo, quality=90)
    results = [process_image(data)] + ([decode_image(data), inspect_image(data)] if slow_stage == "to_rgb" else [])
    for result in results:
        assert isinstance(result, Rejection) and result.reason == "decode_timeout", (slow_stage, result)
    monkeypatch.setattr(module, slow_stage, real)
    assert isinstance(process_image(data), Processed) and isinstance(inspect_image(data), ImageFacts)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "GIF", "BMP", "TIFF", "WEBP"])
def test_the_budget_covers_header_parsing_and_the_decode_loop(photo: Image.Image, monkeypatch, fmt: str) -> None:
    """Every read Pillow makes checks the deadline: a clock that jumps 60 s per read refuses any
    format while its header is parsed, and, armed only once the image is open, while the decoder
    is fed (WebP is decoded from what its header parse read: no read in its decode loop)."""
    clock = FakeClock()
    monkeypatch.setattr(budget, "time", SimpleNamespace(monotonic=clock))
    real, armed = budget.BudgetedReader.read, [True]

    def slow_read(self: budget.BudgetedReader, size: int = -1) -> bytes:
        clock.now += 60 if armed[0] else 0
        return real(self, size)

    monkeypatch.setattr(budget.BudgetedReader, "read", slow_read)
    source = photo.convert("P") if fmt == "GIF" else photo
    buffer = io.BytesIO()
    source.save(buffer, fmt)
    data = buffer.getvalue()
    result = decode_image(data)
    assert isinstance(result, Rejection) and result.reason == "decode_timeout", (fmt, result)
    assert "at reading the image" in result.message
    if fmt == "WEBP":
        return
    armed[0] = False
    opened = decode_module.open_image(data)
    assert not isinstance(opened, Rejection)
    armed[0] = True
    result = decode_module.decode_opened(opened, orientation=1)  # known: a PNG's EXIF read loads it
    assert isinstance(result, Rejection) and result.reason == "decode_timeout", (fmt, result)
    assert "at reading the image" in result.message
