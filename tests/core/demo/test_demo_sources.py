"""The demo sources hold at least 300 samples in 4 formats, with every planted case present.

The sources are read back here with plain pyarrow / tarfile / os (not the pipeline's readers),
so a bug in the writer cannot hide behind the same bug in a reader.
"""

from __future__ import annotations

import hashlib
import io
import shutil
import struct
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from PIL import Image, ImageFile, UnidentifiedImageError

from prx_core.demo import build_demo_sources, load_manifest
from prx_core.sources.catalog import load_catalog

FLOOR = 384 * 384


@pytest.fixture(scope="module")
def demo(demo_dir: Path, demo_files):
    return load_manifest(demo_dir), demo_files


def decode(data: bytes) -> Image.Image:
    im = Image.open(io.BytesIO(data))
    im.load()
    return im


def test_size_and_formats(demo_dir: Path, demo) -> None:
    manifest, files = demo
    catalog = load_catalog(demo_dir / "sources.yaml")
    assert {s.format for s in catalog.sources} >= {"parquet", "imagefolder", "webdataset", "huggingface"}
    assert len(files) == len(manifest.samples) >= 300
    assert all(Path(s.uri).exists() for s in catalog.sources)
    per_source = Counter(source for source, _ in files)
    assert min(per_source[s] for s in ("stock_photos", "web_images", "crawl_wds")) >= 80
    assert per_source["hf_photos"] >= 20
    parquet = catalog.get("stock_photos")
    table = pq.read_table(next(Path(parquet.uri).glob("*.parquet")))
    assert table.schema.field(parquet.embedding_column).type.list_size == 512


def test_the_hf_source_is_what_the_datasets_library_reads(demo_dir: Path, demo) -> None:
    """The Hub-layout demo source, read by the real `datasets` (a test tool, never a runtime
    dependency): an Image() feature, a `text` column, every planted row and byte."""
    import datasets

    manifest, files = demo
    loaded = datasets.load_dataset("parquet", data_files=str(demo_dir / "hf_photos" / "data" / "*.parquet"),
                                   split="train", cache_dir=str(demo_dir.parent / "hf-cache"))
    assert isinstance(loaded.features["image"], datasets.Image)
    assert loaded.features["text"] == datasets.Value("string")
    raw = loaded.cast_column("image", datasets.Image(decode=False))
    got = {row["id"]: (row["image"]["bytes"], row["text"]) for row in raw}
    want = {key: value for (source, key), value in files.items() if source == "hf_photos"}
    assert got == want and len(got) == len([s for s in manifest.samples if s.source == "hf_photos"])


def test_every_sample_matches_its_manifest_entry(demo) -> None:
    manifest, files = demo
    for s in manifest.samples:
        data, caption = files[(s.source, s.key)]
        assert caption == s.caption and len(caption.split()) >= 3
        if s.reject is None:
            with Image.open(io.BytesIO(data)) as im:
                sideways = im.getexif().get(0x0112) in (5, 6, 7, 8)
                assert (im.size[::-1] if sideways else im.size) == tuple(s.size), s


def members(manifest, kind: str):
    found = [s for s in manifest.samples if kind in s.kinds]
    assert found, f"no planted {kind}"
    return found


def test_duplicates_across_sources_at_different_resolutions(demo) -> None:
    manifest, files = demo
    groups: dict[str, dict[str, object]] = {}
    for s in members(manifest, "duplicate"):
        groups.setdefault(s.group, {})[s.role] = s
    assert len(groups) >= 8
    roles = Counter(role for g in groups.values() for role in g)
    assert roles["reencode"] >= 3 and roles["copy"] >= 3 and roles["resize50"] == len(groups)
    for group in groups.values():
        original, half = group["original"], group["resize50"]
        assert len({s.source for s in group.values()}) == 3
        assert half.size == (original.size[0] // 2, original.size[1] // 2)
        raw = files[(original.source, original.key)][0]
        if "copy" in group:
            assert files[(group["copy"].source, group["copy"].key)][0] == raw
        else:
            reencode = group["reencode"]
            assert reencode.size == original.size
            assert files[(reencode.source, reencode.key)][0] != raw


def test_text_heavy_images_with_saying_captions(demo) -> None:
    manifest, _ = demo
    text = members(manifest, "text_heavy")
    assert {"document", "spreadsheet", "slide", "screenshot"} <= {k for s in text for k in s.kinds}
    assert {s.source for s in text} == {s.name for s in load_catalog(Path(manifest.root) / "sources.yaml").sources}  # every source
    for s in text:
        assert any(w in s.caption.lower() for w in ("document", "spreadsheet", "slide", "screenshot"))


def test_out_of_bounds_sizes(demo) -> None:
    manifest, files = demo
    for s in members(manifest, "small"):
        w, h = decode(files[(s.source, s.key)][0]).size
        assert w * h < FLOOR and s.reject == "below_floor"
    for s in members(manifest, "aspect_ratio"):
        w, h = decode(files[(s.source, s.key)][0]).size
        assert not 0.5 <= w / h <= 2.0 and s.reject == "aspect_ratio"


@pytest.mark.parametrize(
    ("kind", "modes", "fmt"),
    [
        ("rgba", {"RGBA"}, "PNG"),
        ("la", {"LA"}, "PNG"),
        ("palette", {"P"}, None),
        ("grayscale", {"L", "LA"}, None),
        ("grayscale16", {"I;16", "I"}, "PNG"),
        ("cmyk", {"CMYK"}, "JPEG"),
        ("bmp", {"RGB"}, "BMP"),
        ("tiff", {"RGB"}, "TIFF"),
        ("webp", {"RGB"}, "WEBP"),
    ],
)
def test_modes_and_formats(demo, kind: str, modes: set[str], fmt: str | None) -> None:
    manifest, files = demo
    transparent = 0
    for s in members(manifest, kind):
        im = decode(files[(s.source, s.key)][0])
        assert im.mode in modes, (s.key, im.mode)
        if fmt:
            assert im.format == fmt
        if kind == "rgba":
            transparent += im.getchannel("A").getextrema()[0] < 255
    if kind == "rgba":
        assert transparent >= 2  # the vignetted photos really are transparent somewhere


def test_exif_rotated(demo) -> None:
    manifest, files = demo
    orientations = set()
    for s in members(manifest, "exif_rotated"):
        im = decode(files[(s.source, s.key)][0])
        orientation = im.getexif().get(0x0112)
        orientations.add(orientation)
        if orientation in (6, 8):
            assert im.size == tuple(s.size)[::-1]  # stored sideways
    assert orientations == {3, 6, 8}


def test_hostile_files(demo) -> None:
    manifest, files = demo
    expected = {"truncated": "truncated", "zero_byte": "empty", "not_an_image": "not_an_image",
                "pixel_bomb": "too_many_pixels", "format_not_allowed": "format_not_allowed"}
    for kind, reason in expected.items():
        for s in members(manifest, kind):
            assert s.reject == reason
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False
    for s in members(manifest, "truncated"):
        with pytest.raises(OSError):
            decode(files[(s.source, s.key)][0])
    assert all(files[(s.source, s.key)][0] == b"" for s in members(manifest, "zero_byte"))
    for s in members(manifest, "not_an_image"):
        with pytest.raises(UnidentifiedImageError):
            Image.open(io.BytesIO(files[(s.source, s.key)][0]))
    for s in members(manifest, "pixel_bomb"):
        data = files[(s.source, s.key)][0]
        width, height = struct.unpack(">II", data[16:24])  # PNG IHDR, read without Pillow
        assert data[12:16] == b"IHDR" and width * height > 100_000_000 and len(data) < 10_000
    for s in members(manifest, "format_not_allowed"):
        with Image.open(io.BytesIO(files[(s.source, s.key)][0])) as im:
            assert im.format == "PPM"


def test_build_is_deterministic(demo_dir: Path, tmp_path: Path) -> None:
    """A second build, in place over a copy of the session's (with a file an older build left),
    gives the same bytes and replaces the folder whole."""
    def digest(folder: Path) -> dict[str, str]:
        return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(folder.rglob("*")) if p.is_file()}

    built = digest(demo_dir)
    shutil.copytree(demo_dir, tmp_path / "a")
    (tmp_path / "a" / "stock_photos" / "left_over.parquet").write_bytes(b"from an older build")
    again = build_demo_sources(tmp_path / "a")  # as the session's was built: wallpapers where installed
    assert len(again.samples) >= 300
    assert digest(tmp_path / "a") == built
    assert not (tmp_path / "a.partial").exists()
