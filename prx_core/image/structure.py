"""Bounded walks of a container's structure, before any decoder (or Pillow's header parser) runs.

Decoding time can grow with the number of pieces a file is made of rather than with its pixels:
libjpeg decodes every scan of a progressive JPEG over the whole coefficient buffer, so a 16 MP
JPEG of 0.12 MiB whose last scan was repeated 1,000 times took 6-14 s (linear in scans: hours at
64 MiB), and Pillow parses JPEG marker segments and PNG chunks one by one in Python, keeping
what it read (1M empty PNG chunks, 11 MiB: 3.6 s and 183 MiB; 1M empty APP5 segments, 4 MB:
1.6 s and 112 MiB; both linear up to the 64 MiB a source allows). These walks only
read lengths and marker bytes (entropy-coded data is skipped by a regular expression, in C) and
stop at the first limit passed, so their own cost is bounded by the limits. A structure they cannot
follow is left to the decoder and the integrity checks, which report it with their usual reasons.
"""

from __future__ import annotations

import re
import struct

from prx_core.image.broken import Broken
from prx_core.image.integrity import PNG_SIGNATURE

TOO_MANY_SCANS = "too_many_scans"
TOO_MANY_SEGMENTS = "too_many_segments"
TOO_MANY_CHUNKS = "too_many_chunks"

# libjpeg's default progressive script has 10 scans (6 for greyscale), mozjpeg's searched scripts
# stay under 30, and a baseline JPEG has one scan per component at most.
MAX_JPEG_SCANS = 100
# Markers of any kind up to the end of the image (APPn, COM, DQT, DHT, SOS, ...): real files hold
# tens (an ICC profile split over APP2 segments, a DHT before each progressive scan).
MAX_JPEG_MARKERS = 1_000
# A 64 MiB PNG written in libpng's 8 KiB IDAT chunks has 8,192 chunks; 1 KiB chunks, 65,536.
MAX_PNG_CHUNKS = 100_000

# A marker: 0xFF then a code that is not stuffing (00), a restart marker (D0-D7) or fill (FF).
_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")
_STANDALONE = {0x01, 0xD8, 0xD9}  # TEM, SOI, EOI: no length field
_SOS, _EOI = 0xDA, 0xD9


def check_structure(data: bytes) -> None:
    """Raise `Broken` when a JPEG or PNG is made of more pieces than real images use."""
    if data[:3] == b"\xff\xd8\xff":
        check_jpeg_markers(data)
    elif data[:8] == PNG_SIGNATURE:
        check_png_chunks(data)


def check_jpeg_markers(data: bytes) -> None:
    """Count the scans (SOS) and markers of the first image, up to its EOI (the decoder stops
    there): `too_many_scans` above `MAX_JPEG_SCANS`, `too_many_segments` above `MAX_JPEG_MARKERS`."""
    pos, markers, scans = 2, 0, 0
    while (found := _MARKER.search(data, pos)) is not None:
        start, code = found.start(), data[found.start() + 1]
        markers += 1
        if markers > MAX_JPEG_MARKERS:
            raise Broken(TOO_MANY_SEGMENTS, f"JPEG has more than {MAX_JPEG_MARKERS} marker segments "
                         f"(at byte {start} of {len(data)}); real images have tens")
        if code == _EOI:
            return
        if code in _STANDALONE:
            pos = start + 2
            continue
        if start + 4 > len(data):
            return  # cut inside a marker: the decoder reports the truncation
        if code == _SOS:
            scans += 1
            if scans > MAX_JPEG_SCANS:
                raise Broken(TOO_MANY_SCANS, f"JPEG has more than {MAX_JPEG_SCANS} scans (scan {scans} at "
                             f"byte {start} of {len(data)}); each scan is decoded over the whole image")
        pos = start + 2 + struct.unpack_from(">H", data, start + 2)[0]


def check_png_chunks(data: bytes) -> None:
    """Count the chunks up to IEND: `too_many_chunks` above `MAX_PNG_CHUNKS`."""
    pos, chunks = len(PNG_SIGNATURE), 0
    while pos + 8 <= len(data):
        chunks += 1
        if chunks > MAX_PNG_CHUNKS:
            raise Broken(TOO_MANY_CHUNKS, f"PNG has more than {MAX_PNG_CHUNKS} chunks (at byte {pos} of "
                         f"{len(data)}); real images have at most thousands")
        length, kind = struct.unpack_from(">I4s", data, pos)
        if kind == b"IEND":
            return
        pos += 12 + length
