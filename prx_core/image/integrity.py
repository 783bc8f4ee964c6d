"""Container checks Pillow's decoders skip, so corrupt data is refused instead of decoded to filler.

Pillow (and pillow-simd) never verify the CRC of PNG data chunks and stop inflating once they
have their rows: an IDAT of zeros decoded to a flat grey image (pHash 0), a short deflate stream
to an image padded with its last rows, and a TIFF whose last strip was cut to grey pixels. These
checks read only the bytes already in memory, with no pixel buffer: CRCs of every PNG chunk,
the PNG deflate stream inflated to nowhere (its length and Adler-32 checked), TIFF strips within
the file and their deflate streams complete, and a WebP's RIFF sizes. JPEG and lossy WebP have
no checksum: a flipped byte in their entropy data still decodes (to damaged pixels); their
truncation is caught by the decoder itself.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable

from PIL import Image

TRUNCATED = "truncated"
CORRUPT = "corrupt_image"

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_INFLATE_STEP = 1 << 20  # inflated bytes held at once while counting a stream
_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
_TIFF_DEFLATE = (8, 32946)


class Broken(ValueError):
    """A container that fails its own integrity rules: `reason` is `truncated` or `corrupt_image`."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def check_riff(data: bytes) -> None:
    """A WebP whose RIFF size or a chunk runs past the end of the data was cut short."""
    if not (data[:4] == b"RIFF" and data[8:12] == b"WEBP"):
        return
    declared = struct.unpack_from("<I", data, 4)[0] + 8 if len(data) >= 8 else 0
    if len(data) < declared:
        raise Broken(TRUNCATED, f"WebP declares {declared} bytes, {len(data)} present")
    pos = 12
    while pos + 8 <= declared:
        kind, size = data[pos : pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        if pos + 8 + size > declared:
            raise Broken(TRUNCATED, f"WebP chunk {kind!r} at byte {pos} runs past the end of the data")
        pos += 8 + size + (size & 1)


def check_container(data: bytes, image: Image.Image) -> None:
    """Raise `Broken` when `data` (opened as `image`) fails its format's integrity rules (WebP's
    are checked before opening: `check_riff`)."""
    if image.format == "PNG":
        check_png(data)
    elif image.format == "TIFF":
        check_tiff(data, image)


def check_png(data: bytes) -> None:
    """Every chunk complete and matching its CRC, an IEND, and one deflate stream over the IDAT
    chunks that ends (Adler-32 verified by zlib) exactly at the size the IHDR implies."""
    view = memoryview(data)
    pos, header, idat = len(PNG_SIGNATURE), None, []
    while True:
        if pos + 8 > len(data):
            raise Broken(TRUNCATED, f"PNG ends at byte {len(data)} before its IEND chunk")
        length, kind = struct.unpack_from(">I4s", data, pos)
        end = pos + 12 + length
        if end > len(data):
            raise Broken(TRUNCATED, f"PNG chunk {kind!r} at byte {pos} runs past the end of the data")
        body = view[pos + 8 : pos + 8 + length]
        if zlib.crc32(view[pos + 4 : pos + 8 + length]) != struct.unpack_from(">I", data, pos + 8 + length)[0]:
            raise Broken(CORRUPT, f"PNG chunk {kind.decode('latin-1')!r} at byte {pos} fails its CRC")
        if kind == b"IHDR":
            header = bytes(body)
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
        pos = end
    if header is None or len(header) != 13 or not idat:
        raise Broken(CORRUPT, "PNG without a valid IHDR or any IDAT chunk")
    width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", header)
    expected = png_raw_size(width, height, depth * _PNG_CHANNELS.get(color, 0), interlace == 1)
    inflated = inflated_size(idat, "PNG image data")
    if inflated != expected:
        raise Broken(CORRUPT, f"PNG image data inflates to {inflated} bytes, its header implies {expected}")


def png_raw_size(width: int, height: int, bits_per_pixel: int, interlaced: bool) -> int:
    """Filtered scanline bytes of a PNG image: a filter byte per row, rows rounded up to bytes."""
    passes = _ADAM7 if interlaced else ((0, 0, 1, 1),)
    total = 0
    for x0, y0, dx, dy in passes:
        cols = (width - x0 + dx - 1) // dx if width > x0 else 0
        rows = (height - y0 + dy - 1) // dy if height > y0 else 0
        if cols and rows:
            total += rows * (1 + (cols * bits_per_pixel + 7) // 8)
    return total


def inflated_size(pieces: Iterable[memoryview], what: str) -> int:
    """Inflate one zlib stream to nowhere (at most `_INFLATE_STEP` bytes held); its length, or
    `Broken` when it is invalid or does not end."""
    stream, total = zlib.decompressobj(), 0
    try:
        for piece in pieces:
            chunk = stream.decompress(piece, _INFLATE_STEP)
            total += len(chunk)
            while stream.unconsumed_tail and not stream.eof:
                total += len(stream.decompress(stream.unconsumed_tail, _INFLATE_STEP))
            if stream.eof:
                break
    except zlib.error as exc:
        raise Broken(CORRUPT, f"{what}: invalid deflate stream ({exc})") from exc
    if not stream.eof:
        raise Broken(CORRUPT, f"{what}: the deflate stream ends early (after {total} bytes)")
    return total


def check_tiff(data: bytes, image: Image.Image) -> None:
    """The first page's strips or tiles lie within the data; deflate ones are complete streams."""
    tags = getattr(image, "tag_v2", None)
    if tags is None:
        return
    offsets = tags.get(273) or tags.get(324)
    counts = tags.get(279) or tags.get(325)
    if offsets is None or counts is None:
        return
    offsets = offsets if isinstance(offsets, tuple) else (offsets,)
    counts = counts if isinstance(counts, tuple) else (counts,)
    view = memoryview(data)
    for number, (offset, count) in enumerate(zip(offsets, counts)):
        if offset + count > len(data):
            raise Broken(TRUNCATED, f"TIFF strip {number} ends at byte {offset + count}, past the data ({len(data)})")
        if tags.get(259) in _TIFF_DEFLATE and count:
            inflated_size([view[offset : offset + count]], f"TIFF strip {number}")
