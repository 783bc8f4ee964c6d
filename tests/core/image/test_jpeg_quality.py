"""JPEG quality estimation: Pillow-encoded real photos round-trip exactly, anything else is None.

Exact recovery is checked together with `rmse == 0`: reading the tables in the wrong order
(zigzag vs natural) still lands within 1..3 of the true quality, so only the residual catches it.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import skimage
from PIL import Image

from prx_core.image.jpeg_quality import (
    estimate_jpeg_quality,
    estimate_jpeg_quality_with_error,
    standard_tables,
)

SKIMAGE_DATA = Path(skimage.__file__).parent / "data"
PHOTOS = ["astronaut.png", "coffee.png"]
QUALITIES = [1, 10, 50, 75, 85, 92, 95, 100]
Photos = dict[tuple[str, str], Image.Image]


def photo(name: str, mode: str = "RGB") -> Image.Image:
    with Image.open(SKIMAGE_DATA / name) as image:
        return image.convert(mode)


def encode(image: Image.Image, fmt: str = "JPEG", **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def zigzag_to_natural() -> list[int]:
    """Zigzag scan (T.81 figure A.6) derived from scratch: anti-diagonals, alternating direction."""
    cells = [(row, col) for row in range(8) for col in range(8)]
    cells.sort(key=lambda rc: (rc[0] + rc[1], rc[0] if (rc[0] + rc[1]) % 2 else -rc[0]))
    return [row * 8 + col for row, col in cells]


@pytest.fixture(scope="module")
def photos() -> Photos:
    return {(name, mode): photo(name, mode) for name in PHOTOS for mode in ("RGB", "L")}


@pytest.mark.parametrize("quality", QUALITIES)
@pytest.mark.parametrize("mode", ["RGB", "L"])
@pytest.mark.parametrize("name", PHOTOS)
def test_pillow_quality_is_recovered_exactly(
    photos: Photos, name: str, mode: str, quality: int
) -> None:
    data = encode(photos[name, mode], quality=quality)
    assert estimate_jpeg_quality(data) == quality
    assert estimate_jpeg_quality_with_error(data) == (quality, 0.0)


@pytest.mark.parametrize("mode", ["RGB", "L"])
def test_every_quality_from_1_to_100_round_trips(mode: str) -> None:
    tile = photo("astronaut.png", mode).crop((200, 100, 264, 164))
    recovered = [estimate_jpeg_quality(encode(tile, quality=q)) for q in range(1, 101)]
    assert recovered == list(range(1, 101))


def test_pillow_default_quality_is_75(photos: Photos) -> None:
    assert estimate_jpeg_quality(encode(photos["coffee.png", "RGB"])) == 75


@pytest.mark.parametrize("quality", [50, 75, 92])
@pytest.mark.parametrize("subsampling", [0, 1, 2], ids=["4:4:4", "4:2:2", "4:2:0"])
def test_chroma_subsampling_does_not_change_the_estimate(
    photos: Photos, subsampling: int, quality: int
) -> None:
    data = encode(photos["astronaut.png", "RGB"], quality=quality, subsampling=subsampling)
    assert estimate_jpeg_quality_with_error(data) == (quality, 0.0)


@pytest.mark.parametrize("quality", [10, 85])
@pytest.mark.parametrize("mode", ["RGB", "L"])
def test_opened_image_and_bytes_agree(photos: Photos, mode: str, quality: int) -> None:
    data = encode(photos["coffee.png", mode], quality=quality)
    with Image.open(io.BytesIO(data)) as image:
        assert estimate_jpeg_quality(image) == estimate_jpeg_quality(data) == quality
        image.load()  # decoding must not lose the header's tables
        assert estimate_jpeg_quality(image) == quality


def test_pillow_quantization_is_natural_order_while_the_file_is_zigzag(photos: Photos) -> None:
    """Pins down the order the estimator relies on (Pillow >= 8.3 de-zigzags on read)."""
    data = encode(photos["coffee.png", "L"], quality=50)
    luma = standard_tables(50)[0].reshape(64)
    with Image.open(io.BytesIO(data)) as image:
        assert list(image.quantization) == [0]
        assert image.quantization[0] == luma.tolist()
    dqt = data.index(b"\xff\xdb")
    in_file = list(data[dqt + 5 : dqt + 5 + 64])  # after marker, length, Pq/Tq
    assert in_file == luma[zigzag_to_natural()].tolist()
    assert in_file != luma.tolist()


def test_standard_tables_follow_libjpeg_scaling() -> None:
    luma50, chroma50 = standard_tables(50)
    assert luma50.shape == chroma50.shape == (8, 8)
    assert luma50[0].tolist() == [16, 11, 10, 16, 24, 40, 51, 61]  # Annex K.1, unscaled
    assert chroma50[0].tolist() == [17, 18, 24, 47, 99, 99, 99, 99]  # Annex K.2
    assert (standard_tables(100)[0] == 1).all()  # scale 0, clamped up to 1
    assert (standard_tables(1)[1] == 255).all()  # scale 5000, force_baseline caps at 255
    assert standard_tables(75)[0][0, 0] == (16 * 50 + 50) // 100


def real_world_jpegs() -> list[Path]:
    """skimage's camera/Photoshop JPEGs always; one installed wallpaper too when there is one."""
    paths = [SKIMAGE_DATA / "rocket.jpg", SKIMAGE_DATA / "hubble_deep_field.jpg"]
    wallpapers = sorted(Path("/usr/share/wallpapers").glob("*/contents/images/*.jpg"))
    return paths + wallpapers[:1]


@pytest.mark.parametrize("path", real_world_jpegs(), ids=lambda p: p.name)
def test_real_world_jpeg_gives_a_quality(path: Path) -> None:
    data = path.read_bytes()
    quality = estimate_jpeg_quality(data)
    assert isinstance(quality, int) and 1 <= quality <= 100
    with Image.open(path) as image:
        assert estimate_jpeg_quality(image) == quality


@pytest.mark.parametrize("name", ["rocket.jpg", "hubble_deep_field.jpg"])
def test_non_ijg_tables_are_flagged_by_the_residual(name: str) -> None:
    estimate = estimate_jpeg_quality_with_error((SKIMAGE_DATA / name).read_bytes())
    assert estimate is not None and estimate.rmse > 1.0


@pytest.mark.parametrize(
    "qtables",
    [[[2] * 64], [[2] * 64, [3] * 64], [[2] * 64, [3] * 64, [4] * 64], [list(range(1, 65))] * 2],
    ids=["one", "two", "three", "ramp"],
)
def test_custom_qtables_give_some_quality(photos: Photos, qtables: list[list[int]]) -> None:
    data = encode(photos["coffee.png", "RGB"], qtables=qtables)
    estimate = estimate_jpeg_quality_with_error(data)
    assert estimate is not None and 1 <= estimate.quality <= 100
    assert estimate.rmse > 0.0


def test_huge_dimensions_do_not_trip_the_decompression_bomb_guard(photos: Photos) -> None:
    """Only the header is read, so a 65535x65535 panorama still gets its quality."""
    data = bytearray(encode(photos["coffee.png", "RGB"], quality=90))
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = b"\xff\xff\xff\xff"  # height, width after marker, length, P
    with pytest.raises(Image.DecompressionBombError):
        Image.open(io.BytesIO(data))
    assert estimate_jpeg_quality(bytes(data)) == 90
    assert estimate_jpeg_quality(memoryview(data)) == 90


@pytest.mark.parametrize("marker", [b"\xff\xd8", b"\xff\xdb", b"\xff\xc0", b"\xff\xda"])
@pytest.mark.parametrize("offset", [0, 7])
def test_truncated_jpeg_header_is_none(photos: Photos, marker: bytes, offset: int) -> None:
    data = encode(photos["coffee.png", "RGB"], quality=85)
    assert estimate_jpeg_quality(data[: data.index(marker) + offset]) is None


def test_truncated_scan_data_still_has_its_header(photos: Photos) -> None:
    data = encode(photos["coffee.png", "RGB"], quality=85)
    assert estimate_jpeg_quality(data[: len(data) // 2]) == 85  # header-only: pixels never read


@pytest.mark.parametrize("fmt", ["PNG", "WEBP", "GIF", "BMP"])
def test_other_formats_are_none(photos: Photos, fmt: str) -> None:
    data = encode(photos["coffee.png", "RGB"], fmt)
    assert estimate_jpeg_quality(data) is None
    with Image.open(io.BytesIO(data)) as image:
        assert estimate_jpeg_quality(image) is None


@pytest.mark.parametrize(
    "data",
    [
        b"",
        np.random.default_rng(0).bytes(4096),
        b"\xff\xd8\xff" + np.random.default_rng(1).bytes(4096),  # JPEG magic, garbage after
        b"not an image at all",
    ],
    ids=["empty", "random", "magic-then-random", "text"],
)
def test_garbage_bytes_are_none(data: bytes) -> None:
    assert estimate_jpeg_quality(data) is None
    assert estimate_jpeg_quality_with_error(data) is None


def test_in_memory_image_without_tables_is_none(photos: Photos) -> None:
    assert estimate_jpeg_quality(photos["coffee.png", "RGB"]) is None
    with Image.open(io.BytesIO(encode(photos["coffee.png", "RGB"], quality=80))) as image:
        assert estimate_jpeg_quality(image.convert("RGB")) is None  # a copy drops the header
