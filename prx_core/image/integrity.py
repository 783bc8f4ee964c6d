"""Container checks Pillow's decoders skip, so corrupt data is refused instead of decoded to filler.

Pillow (and pillow-simd) never verify the CRC of PNG data chunks and stop inflating once they
have their rows: an IDAT of zeros decoded to a flat grey image (pHash 0), a short deflate stream
to an image padded with its last rows, and a TIFF whose last strip was cut to grey pixels. These
checks read only the bytes already in memory, with no pixel buffer: CRCs of every PNG chunk,
the PNG deflate stream inflated to nowhere as its chunks are read (its length and Adler-32
checked, refused one byte past the size the header implies), TIFF strips within the file and
their deflate streams complete (each refused past its strip's raw size), and a WebP's RIFF sizes. JPEG and lossy WebP have
no checksum: a flipped byte in their entropy data still decodes (to damaged pixels); their
truncation is caught by the decoder itself.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

from PIL import Image

from prx_core.image.broken import CORRUPT, TRUNCATED, Broken

if TYPE_CHECKING:
    from prx_core.image.budget import Deadline

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_INFLATE_STEP = 1 << 20  # inflated bytes held at once while counting a stream
_FEED_STEP = 1 << 16  # compressed bytes handed to zlib at once (its unconsumed tail is a copy)
_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
_TIFF_DEFLATE = (8, 32946)


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


def check_container(data: bytes, image: Image.Image, deadline: Deadline | None = None) -> None:
    """Raise `Broken` when `data` (opened as `image`) fails its format's integrity rules (WebP's
    are checked before opening: `check_riff`)."""
    if image.format == "PNG":
        check_png(data, deadline)
    elif image.format == "TIFF":
        check_tiff(data, image, deadline)


def check_png(data: bytes, deadline: Deadline | None = None) -> None:
    """Every chunk complete and matching its CRC, an IEND, and one deflate stream over the IDAT
    chunks that ends (Adler-32 verified by zlib) exactly at the size the IHDR implies. The stream
    is inflated as its chunks are read and refused one byte past that size."""
    view = memoryview(data)
    pos, header, inflater = len(PNG_SIGNATURE), None, None
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
        if kind == b"IHDR" and header is None and length == 13:
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            if header is None:
                raise Broken(CORRUPT, "PNG image data before a valid IHDR chunk")
            if inflater is None:
                width, height, depth, color, _, _, interlace = header
                expected = png_raw_size(width, height, depth * _PNG_CHANNELS.get(color, 0), interlace == 1)
                inflater = Inflater(expected, "PNG image data", deadline)
            inflater.feed(body)
        elif kind == b"IEND":
            break
        pos = end
    if inflater is None:
        raise Broken(CORRUPT, "PNG without a valid IHDR or any IDAT chunk")
    inflated = inflater.finish()
    if inflated != inflater.limit:
        raise Broken(CORRUPT, f"PNG image data inflates to {inflated} bytes, its header implies {inflater.limit}")


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


class Inflater:
    """One zlib stream inflated to nowhere as its pieces arrive: at most `_FEED_STEP` compressed
    and `_INFLATE_STEP` inflated bytes held at once, refused the moment it passes `limit` bytes
    (a 16 MiB stream of zeros behind a 64x64 header inflated 17 GB before it was refused)."""

    def __init__(self, limit: int, what: str, deadline: Deadline | None = None) -> None:
        self.limit, self.what, self.deadline = limit, what, deadline
        self.stream, self.total = zlib.decompressobj(), 0

    def feed(self, piece: memoryview | bytes) -> None:
        """Inflate `piece`; bytes after the end of the stream are ignored, as the decoders do."""
        view = memoryview(piece)
        try:
            for start in range(0, len(view), _FEED_STEP):
                pending: memoryview | bytes = view[start : start + _FEED_STEP]
                while pending and not self.stream.eof:
                    out = self.stream.decompress(pending, min(_INFLATE_STEP, self.limit + 1 - self.total))
                    self.total += len(out)
                    if self.total > self.limit:
                        raise Broken(CORRUPT, f"{self.what} inflates past the {self.limit} bytes its header implies")
                    if not out and len(self.stream.unconsumed_tail) == len(pending):
                        raise Broken(CORRUPT, f"{self.what}: the deflate stream makes no progress")
                    pending = self.stream.unconsumed_tail
                    if self.deadline is not None:
                        self.deadline.check(f"inflating the {self.what}")
                if self.stream.eof:
                    return
        except zlib.error as exc:
            raise Broken(CORRUPT, f"{self.what}: invalid deflate stream ({exc})") from exc

    def finish(self) -> int:
        """The inflated length; `Broken` when the stream did not end."""
        if not self.stream.eof:
            raise Broken(CORRUPT, f"{self.what}: the deflate stream ends early (after {self.total} bytes)")
        return self.total


def inflated_size(pieces: Iterable[memoryview], what: str, limit: int, deadline: Deadline | None = None) -> int:
    """Inflate one zlib stream to nowhere, refusing it past `limit` bytes; its length, or
    `Broken` when it is invalid, too long or does not end."""
    inflater = Inflater(limit, what, deadline)
    for piece in pieces:
        inflater.feed(piece)
    return inflater.finish()


def check_tiff(data: bytes, image: Image.Image, deadline: Deadline | None = None) -> None:
    """The first page's strips or tiles lie within the data; deflate ones are complete streams,
    each refused past the raw size of its strip or tile."""
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
    limit = tiff_piece_size(image) if tags.get(259) in _TIFF_DEFLATE else 0
    for number, (offset, count) in enumerate(zip(offsets, counts)):
        if offset + count > len(data):
            raise Broken(TRUNCATED, f"TIFF strip {number} ends at byte {offset + count}, past the data ({len(data)})")
        if limit and count:
            inflated_size([view[offset : offset + count]], f"TIFF strip {number}", limit, deadline)


def tiff_piece_size(image: Image.Image) -> int:
    """The most raw bytes one strip or tile of the first page can hold: its rows (strips) or its
    tile, times the bytes of a row of all samples (an upper bound for planar images too)."""
    tags = image.tag_v2  # type: ignore[attr-defined]
    width, height = image.size
    samples, bits = int(tags.get(277) or 1), tags.get(258) or 1
    per_sample = tuple(int(b) for b in bits) if isinstance(bits, tuple) else (int(bits),)
    bits_per_pixel = sum(per_sample) if len(per_sample) == samples else max(per_sample) * samples
    if tags.get(322) and tags.get(323):
        width, rows = int(tags[322]), int(tags[323])
    else:
        rows = min(height, int(tags.get(278) or height))
    return rows * ((width * bits_per_pixel + 7) // 8)
