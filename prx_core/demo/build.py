"""Derive the demo sources deterministically from real offline photos.

Four sources in four formats (parquet, an image folder, WebDataset shards, a Hugging Face dataset in
the Hub's layout), with the hard cases planted on purpose and listed in
`manifest.json` (source, key, kinds, expected reject reason, duplicate group), so tests and
later stages can check that each planted case ends where it should.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import numpy as np
from PIL import Image

from prx_core.demo import synthetic as syn
from prx_core.demo.manifest import DemoManifest, Planted
from prx_core.demo.photos import BasePhoto, load_base_photos, skimage_data_dir
from prx_core.demo.writers import (
    FolderSourceWriter,
    HuggingFaceSourceWriter,
    ParquetSourceWriter,
    SourceWriter,
    WebDatasetWriter,
)
from prx_core.sources.catalog import SourceSpec, dump_catalog

SEED = 20261129
SOURCES = (
    SourceSpec("stock_photos", "parquet", "stock_photos", image_column="image", caption_column="caption",
               key_column="key", embedding_column="embedding", weight=1.0),
    SourceSpec("web_images", "imagefolder", "web_images", weight=0.5),
    SourceSpec("crawl_wds", "webdataset", "crawl_wds", weight=1.0),
    # columns from the dataset's features: the first Image() column, and `text`
    SourceSpec("hf_photos", "huggingface", "hf_photos", key_column="id", metadata_columns=("license",), weight=0.5),
)
ASPECTS = (0.56, 0.67, 0.75, 0.8, 1.0, 1.0, 1.25, 1.33, 1.5, 1.78)
DUPLICATE_ASPECTS = (1.0, 1.33, 0.75, 1.5, 0.8)
CROP_WORDS = ("", "Close-up of ", "Detail of ", "Wide shot: ", "Cropped view of ")


# Script, event-handler and javascript: payloads, each of which would mark the page if it ran.
HOSTILE_CAPTION = ('<script>document.title="XSS-script"</script> <img src=x onerror="document.title=\'XSS-onerror\'"> '
                   '<a href="javascript:document.title=\'XSS-link\'">xsslink</a>')


class DemoBuilder:
    def __init__(self, out: Path, photos: list[BasePhoto]) -> None:
        self.rng = np.random.default_rng(SEED)
        self.photos = photos
        self.color = [p for p in photos if p.image.mode == "RGB"]
        self.manifest = DemoManifest(root=str(out))
        self.writers: dict[str, SourceWriter] = {
            "stock_photos": ParquetSourceWriter(out / "stock_photos"),
            "web_images": FolderSourceWriter(out / "web_images"),
            "crawl_wds": WebDatasetWriter(out / "crawl_wds"),
            "hf_photos": HuggingFaceSourceWriter(out / "hf_photos"),
        }
        self.counters: Counter = Counter()

    # -- primitives ------------------------------------------------------------------------
    def add(self, source: str, data: bytes, ext: str, caption: str, kinds: list[str],
            size: tuple[int, int] | None, **extra: object) -> str:
        prefix = {"stock_photos": "sp", "web_images": "img", "crawl_wds": "crawl", "hf_photos": "hf"}[source]
        key = f"{prefix}_{self.counters[source]:05d}"
        self.counters[source] += 1
        self.writers[source].add(key, data, ext, caption)
        fmt = {"jpg": "JPEG", "png": "PNG", "webp": "WEBP", "gif": "GIF", "bmp": "BMP", "tif": "TIFF"}.get(ext, ext)
        self.manifest.samples.append(Planted(source, key, kinds, caption, size, fmt, **extra))
        return key

    def crop(self, photo: BasePhoto, aspect: float, long_side: int) -> Image.Image:
        """A random crop of `photo` at aspect w/h, resized so its long side is `long_side`."""
        W, H = photo.image.size
        cw, ch = (W, int(W / aspect)) if W / H < aspect else (int(H * aspect), H)
        scale = float(self.rng.uniform(0.6, 1.0))
        cw, ch = max(8, int(cw * scale)), max(8, int(ch * scale))
        x, y = int(self.rng.integers(0, W - cw + 1)), int(self.rng.integers(0, H - ch + 1))
        w, h = (long_side, round(long_side / aspect)) if aspect >= 1 else (round(long_side * aspect), long_side)
        return photo.image.crop((x, y, x + cw, y + ch)).resize((w, h), Image.Resampling.LANCZOS)

    def pick(self, pool: list[BasePhoto] | None = None) -> BasePhoto:
        pool = pool or self.color
        return pool[int(self.rng.integers(len(pool)))]

    def caption(self, photo: BasePhoto) -> str:
        lead = CROP_WORDS[int(self.rng.integers(len(CROP_WORDS)))]
        return lead + (photo.caption[0].lower() + photo.caption[1:] if lead else photo.caption)

    def long_side(self, photo: BasePhoto) -> int:
        """Mostly 640-1400 px, sometimes large; never upscale a photo by more than 2x."""
        r = self.rng.random()
        side = int(self.rng.integers(640, 1400) if r < 0.7 else self.rng.integers(1400, 2900))
        return min(side, 2 * max(photo.image.size))

    # -- the composition ---------------------------------------------------------------------
    def regular(self, source: str, count: int, formats: tuple[str, ...]) -> None:
        for _ in range(count):
            photo = self.pick(self.photos)
            aspect = float(ASPECTS[int(self.rng.integers(len(ASPECTS)))] * self.rng.uniform(0.97, 1.03))
            image = self.crop(photo, aspect, self.long_side(photo))
            ext = formats[int(self.rng.integers(len(formats)))]
            data = self._encode(image, ext)
            kinds = ["photo"] + ([ext] if ext != "jpg" else [])
            if image.mode == "L" and ext != "webp":  # WebP stores gray as RGB
                kinds.append("grayscale")
            self.add(source, data, ext, self.caption(photo), kinds, image.size)

    def _encode(self, image: Image.Image, ext: str) -> bytes:
        if ext == "jpg":
            return syn.encode(image, "JPEG", quality=int(self.rng.integers(80, 96)))
        if ext == "webp":
            return syn.encode(image, "WEBP", quality=85)
        return syn.encode(image, "PNG")

    def duplicates(self, groups: int = 10) -> None:
        """Same picture in all three sources: original, 50% resize, re-encode or byte copy."""
        big = [p for p in self.color if min(p.image.size) >= 400] or self.color
        for g in range(groups):
            photo = big[g % len(big)]
            # large enough that the 50% copy is still above the 384x384 floor
            image = self.crop(photo, DUPLICATE_ASPECTS[g % len(DUPLICATE_ASPECTS)], max(1200, min(1600, 2 * max(photo.image.size))))
            original = syn.encode(image, "JPEG", quality=95)
            group = f"dup_{g:02d}"
            common = ["photo", "duplicate"]
            self.add("stock_photos", original, "jpg", photo.caption, common, image.size, group=group, role="original")
            half = image.resize((image.width // 2, image.height // 2), Image.Resampling.LANCZOS)
            self.add("crawl_wds", syn.encode(half, "JPEG", quality=90), "jpg", f"{photo.caption} (thumbnail)",
                     common, half.size, group=group, role="resize50")
            if g < groups // 2 + 1:
                self.add("web_images", syn.encode(image, "JPEG", quality=80), "jpg", f"Photo: {photo.caption}",
                         common, image.size, group=group, role="reencode")
            else:
                self.add("web_images", original, "jpg", photo.caption, common, image.size, group=group, role="copy")

    def text_heavy(self) -> None:
        sizes = {"document": (1240, 1754), "spreadsheet": (1600, 1000), "slide": (1600, 900), "screenshot": (1440, 900)}
        for i in range(12):
            kind = list(syn.TEXT_RENDERERS)[i % 4]
            render, caption = syn.TEXT_RENDERERS[kind]
            image = render(self.rng, sizes[kind])
            source = [s.name for s in SOURCES][i % 3]
            ext = "png" if kind in ("spreadsheet", "screenshot") else "jpg"
            self.add(source, self._encode(image, ext), ext, caption, ["text_heavy", kind], image.size)

    def out_of_bounds(self) -> None:
        """Images below the 384x384 floor and aspect ratios outside [0.5, 2]."""
        small = [(320, 240), (256, 256), (383, 383), (300, 450), (200, 150), (360, 360), (240, 320), (380, 300)]
        for i, size in enumerate(small):
            photo = self.pick()
            image = self.crop(photo, size[0] / size[1], max(size))
            source = ("crawl_wds", "crawl_wds", "web_images", "stock_photos")[i % 4]
            self.add(source, self._encode(image, "jpg"), "jpg", f"Small thumbnail: {photo.caption.lower()}",
                     ["small"], image.size, reject="below_floor")
        wide = [(1800, 600), (2100, 700), (500, 1500), (1200, 400), (2050, 1000), (600, 1250)]
        for i, size in enumerate(wide):
            photo = self.pick()
            image = self.crop(photo, size[0] / size[1], max(size))
            kind = "Panorama" if size[0] > size[1] else "Tall banner"
            caption = f"{kind} of {photo.caption[0].lower()}{photo.caption[1:]}"
            hostile = i == 0  # web text is untrusted: the explorer must render this one inert
            self.add([s.name for s in SOURCES][i % 3], self._encode(image, "jpg"), "jpg",
                     f"{caption} {HOSTILE_CAPTION}" if hostile else caption,
                     ["aspect_ratio", "hostile_caption"] if hostile else ["aspect_ratio"], image.size,
                     reject="aspect_ratio")

    def modes_and_formats(self) -> None:
        """Every colour mode and allowed container the decoder must normalise to RGB."""
        def sample(long_side: int = 900) -> tuple[BasePhoto, Image.Image]:
            photo = self.pick()
            return photo, self.crop(photo, 1.33, long_side)

        photo, im = sample()
        self.add("web_images", syn.rgba_png(im), "png", photo.caption, ["rgba", "png"], im.size)
        photo, im = sample()
        self.add("crawl_wds", syn.rgba_png(im), "png", photo.caption, ["rgba", "png"], im.size)
        with Image.open(skimage_data_dir() / "logo.png") as logo:
            logo_rgba = logo.convert("RGBA")
        self.add("web_images", syn.encode(logo_rgba, "PNG"), "png", "Logo of the scikit-image project on a transparent background",
                 ["rgba", "png", "logo"], logo_rgba.size, reject="below_floor" if logo_rgba.width * logo_rgba.height < 384**2 else None)
        photo, im = sample()
        la = im.convert("LA")
        self.add("web_images", syn.encode(la, "PNG"), "png", photo.caption, ["la", "grayscale", "png"], la.size)
        photo, im = sample()
        self.add("web_images", syn.palette_png(im), "png", photo.caption, ["palette", "png"], im.size)
        photo, im = sample(700)
        self.add("crawl_wds", syn.encode(im.convert("P", palette=Image.Palette.ADAPTIVE), "GIF"), "gif",
                 photo.caption, ["palette", "gif"], im.size)
        gray = [p for p in self.photos if p.image.mode == "L"]
        for source, fn in (("stock_photos", "jpg"), ("web_images", "png")):
            photo = self.pick(gray)
            im = self.crop(photo, 1.0, 800)
            self.add(source, self._encode(im, fn), fn, photo.caption, ["grayscale", fn], im.size)
        photo = self.pick(gray)
        im = self.crop(photo, 1.0, 700)
        self.add("web_images", syn.sixteen_bit_png(im), "png", photo.caption, ["grayscale16", "png"], im.size)
        for source in ("web_images", "stock_photos"):
            photo, im = sample()
            self.add(source, syn.cmyk_jpeg(im), "jpg", photo.caption, ["cmyk"], im.size)
        if (profile := syn.cmyk_profile_path()) is not None:
            photo, im = sample()
            self.add("web_images", syn.cmyk_icc_jpeg(im, profile), "jpg", photo.caption, ["cmyk", "cmyk_icc"], im.size)
        for source, orientation in (("web_images", 6), ("web_images", 8), ("crawl_wds", 3)):
            photo = self.pick()
            im = self.crop(photo, 0.75, 1000)  # portrait upright; stored rotated for 6 and 8
            self.add(source, syn.exif_rotated_jpeg(im, orientation), "jpg", photo.caption,
                     ["exif_rotated", f"orientation_{orientation}"], im.size)
        photo, im = sample()
        self.add("web_images", syn.encode(im, "BMP"), "bmp", photo.caption, ["bmp"], im.size)
        photo, im = sample()
        # uncompressed: libtiff's LZW output was seen to differ between two identical runs
        self.add("web_images", syn.encode(im, "TIFF", compression="raw"), "tif", photo.caption, ["tiff"], im.size)

    def hf_cases(self) -> None:
        """The Hugging Face source's planted cases, drawn last so the other sources stay as they were:
        one text-heavy sample of each kind, one below the floor, one outside [0.5, 2]."""
        sizes = {"document": (1240, 1754), "spreadsheet": (1600, 1000), "slide": (1600, 900), "screenshot": (1440, 900)}
        for kind, (render, caption) in syn.TEXT_RENDERERS.items():
            image = render(self.rng, sizes[kind])
            ext = "png" if kind in ("spreadsheet", "screenshot") else "jpg"
            self.add("hf_photos", self._encode(image, ext), ext, caption, ["text_heavy", kind], image.size)
        photo = self.pick()
        small = self.crop(photo, 4 / 3, 320)
        self.add("hf_photos", self._encode(small, "jpg"), "jpg", f"Small thumbnail: {photo.caption.lower()}", ["small"],
                 small.size, reject="below_floor")
        photo = self.pick()
        wide = self.crop(photo, 3.0, 1800)
        self.add("hf_photos", self._encode(wide, "jpg"), "jpg", f"Panorama of {photo.caption[0].lower()}{photo.caption[1:]}",
                 ["aspect_ratio"], wide.size, reject="aspect_ratio")

    def hostile(self) -> None:
        """Files that must be rejected with a reason, never crash the run."""
        photo, im = self.pick(), None
        im = self.crop(photo, 1.5, 1200)
        full = syn.encode(im, "JPEG", quality=90)
        self.add("web_images", syn.truncated(full), "jpg", photo.caption, ["truncated"], None, reject="truncated")
        photo = self.pick()
        im = self.crop(photo, 1.0, 900)
        self.add("crawl_wds", syn.truncated(syn.encode(im, "JPEG", quality=90), 0.8), "jpg", photo.caption,
                 ["truncated"], None, reject="truncated")
        self.add("web_images", b"", "jpg", "Photo of a beach at sunset", ["zero_byte"], None, reject="empty")
        self.add("web_images", syn.not_an_image_html(), "jpg", "Red sports car parked on a street",
                 ["not_an_image"], None, reject="not_an_image")
        self.add("stock_photos", b"PK\x03\x04" + bytes(self.rng.integers(0, 256, 2000, dtype=np.uint8)), "jpg",
                 "Bowl of fresh fruit on a kitchen table", ["not_an_image"], None, reject="not_an_image")
        self.add("web_images", syn.pixel_bomb_png(), "png", "Aerial view of farmland", ["pixel_bomb"], None,
                 reject="too_many_pixels")
        photo = self.pick()
        self.add("web_images", syn.ppm(self.crop(photo, 1.33, 800)), "jpg", photo.caption,
                 ["format_not_allowed"], None, reject="format_not_allowed")

    def close(self) -> None:
        for writer in self.writers.values():
            writer.close()


def build_demo_sources(out_dir: str | Path, use_wallpapers: bool = True) -> DemoManifest:
    """Write the demo sources, `sources.yaml` and `manifest.json` into `out_dir` (replaced whole)."""
    out = Path(out_dir).resolve()
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    builder = DemoBuilder(staging, load_base_photos(use_wallpapers=use_wallpapers))
    builder.duplicates()
    builder.text_heavy()
    builder.out_of_bounds()
    builder.modes_and_formats()
    builder.hostile()
    for source, count, formats in (("stock_photos", 96, ("jpg",)), ("web_images", 70, ("jpg", "jpg", "png", "webp")),
                                   ("crawl_wds", 90, ("jpg", "jpg", "jpg", "webp")), ("hf_photos", 24, ("jpg", "png"))):
        builder.regular(source, count, formats)
    builder.hf_cases()
    builder.close()
    dump_catalog(list(SOURCES), staging / "sources.yaml")
    manifest = builder.manifest
    manifest.root = str(out)
    (staging / "manifest.json").write_text(json.dumps([asdict(s) for s in manifest.samples], indent=1))
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return manifest
