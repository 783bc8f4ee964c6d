"""A labelled set of real photos for measuring deduplication: which files are copies of one picture
and which are different pictures, written as one `imagefolder` source.

Pictures are distinct real images at least 768 px on the short side: scikit-image's photos and
non-overlapping tiles of Debian's KDE and GNOME wallpapers, plus hard cases built from them (flat,
dark and low-contrast tiles; flat tiles under one shared semi-transparent watermark; the light and
dark themes of one artwork, kept as two pictures). Each picture gets:

- copies, which deduplication must find (`DUPLICATE_KINDS`): JPEG re-encodes at q75/q85/q95, a
  PNG and a lossless WebP of the same pixels, a WebP at q90, Lanczos resizes to 75% and 50% (JPEG
  q90), 50% then q75, and a byte copy;
- variants, which are other pictures and must never join its group (`VARIANT_KINDS`, on every
  `variant_every`-th picture): a mirror image, a 10% crop, a 5-degree rotation, +40% brightness.
  A variant that looks the same as any picture or variant of the set (32x32 area averages within
  `DISTINCT_LEVELS`: the mirror image of a flat tile, a 5-degree turn of a round fundus photo, two
  near-white tiles brightened to white) is left out, and so is a picture that looks the same as an
  earlier one.

The labels (`labels.json`: per file its picture, its kind and whether it is a duplicate of the
picture's original) are written beside the images, never read by the pipeline.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageEnhance, ImageFont

from prx_core.demo.photos import find_wallpapers, load_skimage_photos

MIN_SIDE = 768  # a picture's short side: its 50% copy (>= 384 px) is still above the pipeline's floor
TILE = (1024, 768)  # wallpaper tiles (landscape; every other one portrait)
DUPLICATE_KINDS = ("jpeg_q75", "jpeg_q85", "jpeg_q95", "png", "webp_lossless", "webp_q90",
                   "resize_75", "resize_50", "resize_50_q75", "byte_copy")
VARIANT_KINDS = ("flip", "crop_10", "rotate_5", "brighter_40")
WATERMARK = "© PRX STOCK PHOTOS"
DISTINCT_LEVELS = 4.0  # two pictures whose 32x32 RGB thumbnails differ by less on average look the same


@dataclass(frozen=True)
class Labelled:
    """One file of the set: which picture it shows and how it was made from it."""

    file_name: str
    picture: str  # the picture it is a copy of; a variant is a picture of its own ("<picture>~<kind>")
    kind: str  # "original", a DUPLICATE_KINDS or a VARIANT_KINDS entry
    of: str  # the picture it was made from (itself for an original)
    duplicate: bool  # a copy deduplication must find (originals and variants: False)


def load_pictures(limit: int | None = None, tiles_per_wallpaper: int = 12) -> list[tuple[str, Image.Image]]:
    """Distinct real pictures (name, RGB image) in a stable order: scikit-image's photos, the hard
    cases, then wallpaper tiles (read only as far as `limit` needs). A picture that looks the same
    as an earlier one (two plain corners of one wallpaper) is left out: the set's labels say
    "different pictures" only where a person would see two."""
    pictures: list[tuple[str, Image.Image]] = []
    seen: list[np.ndarray] = []
    for name, image in _candidates(tiles_per_wallpaper):
        if limit is not None and len(pictures) >= limit:
            break
        look = _look(image)
        if all(_differ(look, other) for other in seen):
            pictures.append((name, image))
            seen.append(look)
    return pictures


def _candidates(tiles_per_wallpaper: int) -> Iterator[tuple[str, Image.Image]]:
    photos = [(p.name, p.image.convert("RGB")) for p in load_skimage_photos() if min(p.image.size) >= MIN_SIDE]
    tiles = (tile for path in find_wallpapers() for tile in _wallpaper_tiles(path, tiles_per_wallpaper))
    first = [tile for _, tile in zip(range(6), tiles)]  # the dark and low-contrast cases are made of these
    yield from photos
    yield from _hard_cases(photos + first)
    yield from first
    yield from tiles


def _look(image: Image.Image) -> np.ndarray:
    """What a person sees at a glance: the 32x32 RGB area averages."""
    return np.asarray(image.convert("RGB").resize((32, 32), Image.Resampling.BOX), np.float32)


def _differ(a: np.ndarray, b: np.ndarray) -> bool:
    return float(np.abs(a - b).mean()) >= DISTINCT_LEVELS


def _wallpaper_tiles(path: Path, count: int) -> list[tuple[str, Image.Image]]:
    """Up to `count` non-overlapping tiles of one wallpaper, spread over it (its dark theme too)."""
    out = []
    theme = path.parents[2].name if path.parent.name == "images" else path.stem
    paths = [path]
    dark = path.parents[1] / "images_dark" / path.name
    if path.parent.name == "images" and dark.exists():
        paths.append(dark)  # the dark theme: same artwork, another picture
    for n, source in enumerate(paths):
        with Image.open(source) as im:
            image = im.convert("RGB")  # tiles at the wallpaper's own resolution
        width, height = TILE
        boxes = [(x, y, x + width, y + height) for y in range(0, image.height - height + 1, height)
                 for x in range(0, image.width - width + 1, width)]
        step = max(1, len(boxes) // count)
        suffix = "_dark" if n else ""
        for k, box in enumerate(boxes[::step][:count]):
            tile = image.crop(box)
            out.append((f"{theme}{suffix}_t{k}", tile if k % 2 == 0 else tile.transpose(Image.Transpose.ROTATE_90)))
    return out


def _hard_cases(pictures: list[tuple[str, Image.Image]]) -> list[tuple[str, Image.Image]]:
    """Pictures whose pHash carries little of them: flat, dark, low-contrast, and flat ones that
    share a watermark (the text dominates their hashes)."""
    rng = np.random.default_rng(7)
    out = []
    for n, colour in enumerate([(40, 90, 170), (150, 150, 155), (120, 70, 30), (20, 20, 22), (90, 160, 90)]):
        flat = Image.fromarray(np.clip(np.asarray(colour) + rng.normal(0, 2.0, (768, 1024, 1)), 0, 255).astype(np.uint8))
        out.append((f"flat_{n}_watermark", _watermark(flat, opacity=180)))
    for n, colour in enumerate([(200, 60, 60), (60, 60, 200), (230, 230, 235), (128, 128, 128), (8, 8, 8)]):
        out.append((f"flat_{n}", Image.fromarray(np.clip(np.asarray(colour) + rng.normal(0, 2.0, (768, 1024, 1)), 0,
                                                         255).astype(np.uint8))))
    for name, image in pictures[:6]:
        out.append((f"{name}_dark", ImageEnhance.Brightness(image).enhance(0.12)))
        out.append((f"{name}_lowcontrast", ImageEnhance.Contrast(image).enhance(0.15)))
        out.append((f"{name}_watermark", _watermark(ImageEnhance.Brightness(image).enhance(0.5), opacity=180)))
    return out


def _watermark(image: Image.Image, opacity: int = 140) -> Image.Image:
    """`WATERMARK` across the middle, semi-transparent white, as stock sites stamp their previews."""
    layer = Image.new("RGBA", image.size, (0, 0, 0, 0))
    font = ImageFont.load_default(size=max(24, image.width // 12))
    draw = ImageDraw.Draw(layer)
    box = draw.textbbox((0, 0), WATERMARK, font=font)
    at = ((image.width - (box[2] - box[0])) // 2, (image.height - (box[3] - box[1])) // 2)
    draw.text(at, WATERMARK, font=font, fill=(255, 255, 255, opacity))
    return Image.alpha_composite(image.convert("RGBA"), layer).convert("RGB")


def _encoded(image: Image.Image, fmt: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def _resized(image: Image.Image, factor: float) -> Image.Image:
    size = (round(image.width * factor), round(image.height * factor))
    return image.resize(size, Image.Resampling.LANCZOS)


def _original_bytes(index: int, image: Image.Image) -> tuple[bytes, str]:
    """Originals alternate between PNG and JPEG q95, so copies meet both decode paths."""
    if index % 2:
        return _encoded(image, "JPEG", quality=95), "jpg"
    return _encoded(image, "PNG"), "png"


def _duplicates(image: Image.Image, original: bytes) -> Iterator[tuple[str, bytes, str]]:
    pixels = Image.open(io.BytesIO(original)).convert("RGB")  # a copy starts from what the original decodes to
    for quality in (75, 85, 95):
        yield f"jpeg_q{quality}", _encoded(pixels, "JPEG", quality=quality), "jpg"
    yield "png", _encoded(pixels, "PNG"), "png"
    yield "webp_lossless", _encoded(pixels, "WEBP", lossless=True), "webp"
    yield "webp_q90", _encoded(pixels, "WEBP", quality=90), "webp"
    yield "resize_75", _encoded(_resized(pixels, 0.75), "JPEG", quality=90), "jpg"
    half = _resized(pixels, 0.5)
    yield "resize_50", _encoded(half, "JPEG", quality=90), "jpg"
    yield "resize_50_q75", _encoded(Image.open(io.BytesIO(_encoded(half, "JPEG", quality=90))).convert("RGB"),
                                    "JPEG", quality=75), "jpg"
    yield "byte_copy", original, "png" if original[:4] == b"\x89PNG" else "jpg"


VARIANTS: dict[str, Callable[[Image.Image], Image.Image]] = {
    "flip": lambda im: im.transpose(Image.Transpose.FLIP_LEFT_RIGHT),
    "crop_10": lambda im: im.crop((im.width // 20, im.height // 20, im.width - im.width // 20,
                                   im.height - im.height // 20)).resize(im.size, Image.Resampling.LANCZOS),
    "rotate_5": lambda im: im.rotate(5, Image.Resampling.BICUBIC, expand=False),
    "brighter_40": lambda im: ImageEnhance.Brightness(im).enhance(1.4),
}


def write_dedup_set(folder: Path, limit: int | None = None, variant_every: int = 3) -> list[Labelled]:
    """Write the set as an imagefolder source under `folder` (`images/`, `labels.json`); returns the labels."""
    images = folder / "images"
    images.mkdir(parents=True, exist_ok=True)
    labels: list[Labelled] = []

    def put(name: str, data: bytes, ext: str, picture: str, kind: str, of: str, duplicate: bool) -> None:
        file_name = f"{name}.{ext}"
        (images / file_name).write_bytes(data)
        labels.append(Labelled(file_name, picture, kind, of, duplicate))

    pictures = load_pictures(limit)
    seen = [_look(image) for _, image in pictures]  # a variant must look unlike every picture and variant
    for index, (name, image) in enumerate(pictures):
        original, ext = _original_bytes(index, image)
        put(f"{name}__original", original, ext, name, "original", name, False)
        for kind, data, ext in _duplicates(image, original):
            put(f"{name}__{kind}", data, ext, name, kind, name, True)
        if index % variant_every == 0:
            for kind, make in VARIANTS.items():
                variant = make(image)
                look = _look(variant)
                if all(_differ(look, other) for other in seen):  # a 10% crop of a plain texture is the same picture
                    seen.append(look)
                    put(f"{name}__{kind}", _encoded(variant, "JPEG", quality=95), "jpg", f"{name}~{kind}", kind,
                        name, False)
    (folder / "labels.json").write_text(json.dumps([asdict(label) for label in labels], indent=0))
    return labels


def read_labels(folder: Path) -> list[Labelled]:
    return [Labelled(**row) for row in json.loads((folder / "labels.json").read_text())]
