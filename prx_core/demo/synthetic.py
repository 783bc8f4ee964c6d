"""Synthetic content the demo plants on purpose: text-heavy images and hostile files.

Text-heavy images (documents, spreadsheets, slides, screenshots) are what the caption labeller
must flag as `text`; the hostile files are what safe decoding must reject with a reason.
"""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image, ImageDraw, ImageFont

WORDS = (
    "quarterly revenue growth report summary analysis market customer product team budget "
    "forecast results data review plan strategy update meeting notes section figure table total "
    "increase decrease regional sales operations performance objective schedule milestone"
).split()


def _font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    try:
        return ImageFont.load_default(size=size)
    except (TypeError, ImportError, OSError):  # no FreeType in this Pillow build
        return ImageFont.load_default()


def _sentence(rng: np.random.Generator, n: int) -> str:
    return " ".join(rng.choice(WORDS, size=n)).capitalize()


def render_document(rng: np.random.Generator, size: tuple[int, int]) -> Image.Image:
    """A printed page: title and dense paragraphs."""
    w, h = size
    im = Image.new("RGB", size, (250, 250, 247))
    draw = ImageDraw.Draw(im)
    margin, line = w // 12, max(14, h // 60)
    draw.text((margin, margin), _sentence(rng, 4).upper(), fill=(20, 20, 20), font=_font(line * 2))
    y = margin + line * 4
    while y < h - margin - line:
        if rng.random() < 0.12:
            y += line  # paragraph break
        draw.text((margin, y), _sentence(rng, int(w / (line * 5.5))), fill=(35, 35, 35), font=_font(line))
        y += int(line * 1.5)
    return im


def render_spreadsheet(rng: np.random.Generator, size: tuple[int, int]) -> Image.Image:
    """A spreadsheet screenshot: header row, grid, numbers."""
    w, h = size
    im = Image.new("RGB", size, (255, 255, 255))
    draw = ImageDraw.Draw(im)
    cell_w, cell_h = w // 8, max(22, h // 30)
    font = _font(int(cell_h * 0.6))
    draw.rectangle([0, 0, w, cell_h], fill=(33, 115, 70))
    for c in range(8):
        draw.text((c * cell_w + 6, 4), str(rng.choice(WORDS)).title(), fill="white", font=font)
    for r in range(1, h // cell_h + 1):
        for c in range(8):
            x, y = c * cell_w, r * cell_h
            draw.rectangle([x, y, x + cell_w, y + cell_h], outline=(210, 210, 210))
            text = f"{rng.integers(100, 99999):,}" if c else f"Row {r}"
            draw.text((x + 6, y + 4), text, fill=(20, 20, 20), font=font)
    return im


def render_slide(rng: np.random.Generator, size: tuple[int, int]) -> Image.Image:
    """A presentation slide: coloured title bar and bullet points."""
    w, h = size
    im = Image.new("RGB", size, (245, 247, 252))
    draw = ImageDraw.Draw(im)
    draw.rectangle([0, 0, w, h // 5], fill=(30, 60, 130))
    draw.text((w // 16, h // 14), _sentence(rng, 5), fill="white", font=_font(h // 14))
    for i in range(5):
        y = h // 4 + i * h // 8
        draw.ellipse([w // 16, y + 8, w // 16 + 14, y + 22], fill=(30, 60, 130))
        draw.text((w // 16 + 30, y), _sentence(rng, 7), fill=(30, 30, 30), font=_font(h // 22))
    return im


def render_screenshot(rng: np.random.Generator, size: tuple[int, int]) -> Image.Image:
    """A desktop application screenshot: title bar, sidebar, text panes."""
    w, h = size
    im = Image.new("RGB", size, (236, 236, 236))
    draw = ImageDraw.Draw(im)
    font = _font(max(14, h // 50))
    draw.rectangle([0, 0, w, 36], fill=(60, 60, 64))
    draw.text((12, 8), "Mail - Inbox (42 unread)", fill="white", font=font)
    draw.rectangle([0, 36, w // 5, h], fill=(220, 224, 230))
    for i in range(12):
        draw.text((12, 50 + i * 30), str(rng.choice(WORDS)).title(), fill=(40, 40, 40), font=font)
    for i in range((h - 60) // 34):
        y = 50 + i * 34
        draw.text((w // 5 + 16, y), f"{_sentence(rng, 3)} - {_sentence(rng, 6).lower()}", fill=(25, 25, 25), font=font)
    return im


TEXT_RENDERERS = {
    "document": (render_document, "Scanned page of a printed document with dense paragraphs of text"),
    "spreadsheet": (render_spreadsheet, "Screenshot of a spreadsheet with a green header row and columns of numbers"),
    "slide": (render_slide, "Presentation slide with a blue title bar and a list of bullet points"),
    "screenshot": (render_screenshot, "Screenshot of an email application showing an inbox with a list of messages"),
}


def encode(image: Image.Image, fmt: str = "JPEG", **params: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **params)
    return buf.getvalue()


def exif_rotated_jpeg(upright: Image.Image, orientation: int, quality: int = 90) -> bytes:
    """Store pixels so that applying EXIF `orientation` (3, 6 or 8) shows `upright`."""
    stored = {
        3: upright.transpose(Image.Transpose.ROTATE_180),
        6: upright.transpose(Image.Transpose.ROTATE_90),
        8: upright.transpose(Image.Transpose.ROTATE_270),
    }[orientation]
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(stored, "JPEG", quality=quality, exif=exif.tobytes())


CMYK_PROFILES = ("/usr/share/color/icc/ghostscript/default_cmyk.icc", "/usr/share/color/icc/ghostscript/ps_cmyk.icc")


def cmyk_jpeg(image: Image.Image, quality: int = 90) -> bytes:
    return encode(image.convert("CMYK"), "JPEG", quality=quality)


def cmyk_profile_path() -> str | None:
    """A CMYK ICC profile from Debian's libgs-common, when installed."""
    import os

    return next((p for p in CMYK_PROFILES if os.path.exists(p)), None)


def cmyk_icc_jpeg(image: Image.Image, profile_path: str, quality: int = 90) -> bytes:
    """A print-style CMYK JPEG: separated through a real CMYK profile, which is embedded."""
    from PIL import ImageCms

    with open(profile_path, "rb") as handle:
        icc = handle.read()
    profile = ImageCms.ImageCmsProfile(io.BytesIO(icc))
    cmyk = ImageCms.profileToProfile(image.convert("RGB"), ImageCms.createProfile("sRGB"), profile, outputMode="CMYK")
    return encode(cmyk, "JPEG", quality=quality, icc_profile=icc)


def rgba_png(image: Image.Image) -> bytes:
    """A photo with a transparent vignette: alpha falls to 0 at the corners."""
    w, h = image.size
    yy, xx = np.mgrid[0:h, 0:w]
    dist = np.hypot((xx - w / 2) / (w / 2), (yy - h / 2) / (h / 2))
    alpha = np.clip((1.3 - dist) * 255, 0, 255).astype(np.uint8)
    rgba = image.convert("RGB").copy()
    rgba.putalpha(Image.fromarray(alpha, "L"))
    return encode(rgba, "PNG")


def palette_png(image: Image.Image) -> bytes:
    """A 64-colour palette image with one colour marked transparent."""
    pal = image.convert("RGB").quantize(colors=64)
    return encode(pal, "PNG", transparency=0)


def sixteen_bit_png(image: Image.Image) -> bytes:
    gray = np.asarray(image.convert("L"), dtype=np.uint16) * 257
    return encode(Image.fromarray(gray.astype(np.uint16)), "PNG")


def truncated(data: bytes, keep: float = 0.6) -> bytes:
    return data[: int(len(data) * keep)]


def not_an_image_html() -> bytes:
    return b"<!DOCTYPE html><html><head><title>404 Not Found</title></head><body><h1>Not Found</h1></body></html>\n"


def pixel_bomb_png(width: int = 20000, height: int = 20000) -> bytes:
    """A tiny PNG whose header declares width x height pixels (a decompression bomb)."""

    def chunk(tag: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + tag + payload + struct.pack(">I", zlib.crc32(tag + payload))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit grayscale
    idat = zlib.compress(b"\x00" * 1024)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def ppm(image: Image.Image) -> bytes:
    """A portable pixmap: a real image in a format the pipeline does not allow."""
    return encode(image.convert("RGB"), "PPM")
