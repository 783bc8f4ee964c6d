"""Hostile images built byte by byte for the bomb tests: JPEG marker surgery, hand-made PNG and
TIFF containers, zlib streams that inflate a thousandfold, and an Adam7-interlaced PNG (Pillow
writes none)."""

from __future__ import annotations

import io
import re
import struct
import zlib

import numpy as np
from PIL import Image

_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))


def jpeg_segments(data: bytes) -> list[tuple[int, int, int]]:
    """(marker code, start, end) of every segment after SOI; a scan runs to the next marker."""
    out, pos = [], 2
    while (found := _MARKER.search(data, pos)) is not None:
        start, code = found.start(), data[found.start() + 1]
        if code == 0xD9:
            out.append((code, start, start + 2))
            return out
        end = start + 2 + struct.unpack_from(">H", data, start + 2)[0]
        if code == 0xDA:
            after = _MARKER.search(data, end)
            end = after.start() if after else len(data)
        out.append((code, start, end))
        pos = end
    return out


def scan_count(data: bytes) -> int:
    return sum(1 for code, _, _ in jpeg_segments(data) if code == 0xDA)


def encode_jpeg(image: Image.Image, **params: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", **params)
    return buffer.getvalue()


def repeat_last_scan(jpeg: bytes, extra: int) -> bytes:
    """`jpeg` with its last scan (header and entropy data) repeated `extra` more times before EOI:
    libjpeg decodes each repeat over the whole image."""
    segments = jpeg_segments(jpeg)
    _, start, end = [s for s in segments if s[0] == 0xDA][-1]
    eoi = segments[-1][1]
    return jpeg[:eoi] + jpeg[start:end] * extra + jpeg[eoi:]


def flat_progressive(size: int, extra_scans: int) -> bytes:
    """A flat `size`x`size` progressive JPEG: its last scan (an AC refinement) holds ~30 bytes, so
    thousands of repeats stay a fraction of a MiB."""
    return repeat_last_scan(encode_jpeg(Image.new("RGB", (size, size), (120, 130, 140)), quality=90,
                                        progressive=True), extra_scans)


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_file(width: int, height: int, idat: list[bytes], color: int = 2, interlace: int = 0) -> bytes:
    """An 8-bit PNG with the given IDAT chunk bodies (valid CRCs)."""
    header = struct.pack(">IIBBBBB", width, height, 8, color, 0, 0, interlace)
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + b"".join(png_chunk(b"IDAT", p) for p in idat)
            + png_chunk(b"IEND", b""))


def zeros_stream(mib: int) -> bytes:
    """A zlib stream of `mib` MiB that inflates ~1,000 times larger (zeros, fully flushed blocks
    repeated; its Adler-32 is not right, which only a decoder reaching the end would see)."""
    compressor = zlib.compressobj(9)
    head = compressor.compress(bytes(1 << 20)) + compressor.flush(zlib.Z_FULL_FLUSH)
    block = compressor.compress(bytes(1 << 20)) + compressor.flush(zlib.Z_FULL_FLUSH)
    return head + block * ((mib << 20) // len(block)) + compressor.flush()


def split(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def interlaced_png(pixels: np.ndarray) -> bytes:
    """An Adam7-interlaced RGB PNG of `pixels` (height, width, 3 uint8), filter type 0 per row."""
    height, width, _ = pixels.shape
    raw = bytearray()
    for x0, y0, dx, dy in _ADAM7:
        sub = pixels[y0::dy, x0::dx]
        if sub.shape[0] and sub.shape[1]:
            for row in sub:
                raw += b"\x00" + row.tobytes()
    return png_file(width, height, split(zlib.compress(bytes(raw)), 8192), interlace=1)


def deflate_tiff(width: int, height: int, strip: bytes) -> bytes:
    """A little-endian greyscale TIFF with one deflate strip holding `strip` as stored."""
    entries = [(256, 3, width), (257, 3, height), (258, 3, 8), (259, 3, 8), (262, 3, 1),
               (273, 4, 0), (277, 3, 1), (278, 3, height), (279, 4, len(strip))]
    ifd_size = 2 + 12 * len(entries) + 4
    offset = 8 + ifd_size
    ifd = struct.pack("<H", len(entries))
    for tag, kind, value in entries:
        value = offset if tag == 273 else value
        packed = struct.pack("<HH", value, 0) if kind == 3 else struct.pack("<I", value)
        ifd += struct.pack("<HHI", tag, kind, 1) + packed
    return b"II*\x00" + struct.pack("<I", 8) + ifd + struct.pack("<I", 0) + strip
