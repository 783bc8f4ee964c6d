"""Real photos available offline: scikit-image's bundled samples and Debian's wallpapers.

The wallpapers (gnome-backgrounds, plasma-workspace-wallpapers) are optional: the demo works from
scikit-image alone, and gains large images (up to 5120x2880) where the packages are installed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

WALLPAPER_DIRS = (Path("/usr/share/wallpapers"), Path("/usr/share/backgrounds/gnome"))
WALLPAPER_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")
# Wallpapers are kept in memory at most this long side; big enough for the 2048 tier.
WALLPAPER_MAX_SIDE = 2880

SKIMAGE_PHOTOS = {
    "astronaut.png": "Astronaut Eileen Collins in an orange flight suit smiling in front of an American flag",
    "chelsea.png": "A tabby cat with green eyes looking to the side, close-up",
    "coffee.png": "A cup of coffee with latte art on a white saucer with a spoon, seen from above",
    "hubble_deep_field.jpg": "Hubble Deep Field image with hundreds of distant galaxies on a black sky",
    "ihc.png": "Microscope image of a tissue sample stained brown and blue",
    "motorcycle_left.png": "A motorcycle parked in a workshop next to shelves and a pegboard of tools",
    "retina.jpg": "Fundus photograph of a human retina with blood vessels and the optic disc",
    "rocket.jpg": "A rocket standing on the launch pad against a clear blue sky",
    "camera.png": "Black and white photo of a man with a camera on a tripod in a park",
    "moon.png": "Grayscale close-up of the surface of the Moon with craters",
    "coins.png": "Old coins laid out in rows on a dark background",
    "brick.png": "Texture of a weathered brick wall",
    "grass.png": "Close-up texture of a lawn of green grass",
    "gravel.png": "Texture of grey gravel seen from above",
}


@dataclass(frozen=True)
class BasePhoto:
    """A real photo the demo derives samples from (RGB or L, upright)."""

    name: str
    caption: str
    image: Image.Image
    origin: str


def skimage_data_dir() -> Path:
    import skimage

    return Path(skimage.__file__).parent / "data"


def load_skimage_photos() -> list[BasePhoto]:
    data = skimage_data_dir()
    photos = []
    for filename, caption in SKIMAGE_PHOTOS.items():
        path = data / filename
        if not path.exists():
            continue
        with Image.open(path) as im:
            image = im.convert("L" if im.mode in ("L", "I;16") else "RGB")
        photos.append(BasePhoto(Path(filename).stem, caption, image, f"scikit-image:{filename}"))
    if not photos:
        raise RuntimeError(f"no scikit-image sample photos found under {data}")
    return photos


def find_wallpapers(dirs: tuple[Path, ...] = WALLPAPER_DIRS) -> list[Path]:
    """The largest image of each installed wallpaper, in a stable order."""
    found: list[Path] = []
    for base in dirs:
        if not base.is_dir():
            continue
        if (base / "Altai").exists() or any(base.glob("*/contents")):  # plasma layout
            for theme in sorted(p for p in base.iterdir() if (p / "contents" / "images").is_dir()):
                images = [p for p in (theme / "contents" / "images").iterdir() if p.suffix in WALLPAPER_SUFFIXES]
                if images:
                    found.append(max(images, key=_declared_pixels))
        else:
            found.extend(sorted(p for p in base.iterdir() if p.suffix.lower() in WALLPAPER_SUFFIXES))
    return found


def _declared_pixels(path: Path) -> int:
    try:
        w, h = (int(v) for v in path.stem.split("x"))
        return w * h
    except ValueError:
        return 0


def wallpaper_caption(path: Path) -> str:
    theme = path.parents[2] if path.parent.name == "images" else None
    if theme is not None and (theme / "metadata.json").exists():
        try:
            plugin = json.loads((theme / "metadata.json").read_text())["KPlugin"]
            author = plugin.get("Authors", [{}])[0].get("Name")
            by = f" by {author}" if author else ""
            return f"'{plugin['Name']}' desktop wallpaper artwork{by}"
        except (KeyError, IndexError, ValueError):
            pass
    name = (theme.name if theme else path.stem).replace("-", " ").replace("_", " ")
    return f"'{name}' desktop background image"


def load_wallpapers(limit: int = 24) -> list[BasePhoto]:
    """Up to `limit` wallpapers, downscaled in memory to `WALLPAPER_MAX_SIDE`."""
    photos = []
    for path in find_wallpapers()[:limit]:
        try:
            with Image.open(path) as im:
                im.draft("RGB", (WALLPAPER_MAX_SIDE, WALLPAPER_MAX_SIDE))
                image = im.convert("RGB")
        except (OSError, ValueError):
            continue
        image.thumbnail((WALLPAPER_MAX_SIDE, WALLPAPER_MAX_SIDE), Image.Resampling.LANCZOS)
        theme = path.parents[2].name if path.parent.name == "images" else path.stem
        photos.append(BasePhoto(f"wallpaper_{theme}", wallpaper_caption(path), image, str(path)))
    return photos


def load_base_photos(use_wallpapers: bool = True, wallpaper_limit: int = 24) -> list[BasePhoto]:
    photos = load_skimage_photos()
    if use_wallpapers:
        photos += load_wallpapers(wallpaper_limit)
    return photos
