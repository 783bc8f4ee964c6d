"""Framed int64 files: a magic, a JSON header and one little-endian int64 array a reader maps.

The layout shared by skip-lists (`prx_core.shards.skiplists.files`) and corpus manifests
(`prx_core.shards.manifest`): 8 magic bytes, a little-endian u32 header length, a JSON header
(sorted keys) padded with spaces to 8 bytes, then the array. Mapped, the array's pages are shared
by every process of a node that opens the same file.
"""

from __future__ import annotations

import json
import struct
from typing import BinaryIO

import numpy as np

HEAD = 4096  # bytes read first: most headers fit


def frame(magic: bytes, header: dict, array: np.ndarray) -> bytes:
    return frame_head(magic, header) + np.ascontiguousarray(array, "<i8").tobytes()


def frame_head(magic: bytes, header: dict) -> bytes:
    """Everything before the array: a writer streams the array after it."""
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-(len(magic) + 4 + len(text)) % 8)
    return magic + struct.pack("<I", len(text)) + text


def read_header(data: bytes, magic: bytes, kind: str, where: str) -> tuple[dict, int]:
    """(header, byte offset of the array) from the start of a framed file; ValueError naming `where`.
    `data` may stop after the header; an offset beyond it means "read that much and ask again"."""
    if data[:len(magic)] != magic or len(data) < len(magic) + 4:
        raise ValueError(f"{where}: not a {kind} file (no {magic!r} magic)")
    (length,) = struct.unpack("<I", data[len(magic):len(magic) + 4])
    offset = len(magic) + 4 + length
    if offset > len(data):
        return {}, offset
    try:
        header = json.loads(data[len(magic) + 4:offset])
    except ValueError as exc:
        raise ValueError(f"{where}: unreadable {kind} header: {exc}") from exc
    if not isinstance(header, dict):
        raise ValueError(f"{where}: unreadable {kind} header: not a JSON object")
    return header, offset


def read_head(handle: BinaryIO, magic: bytes, kind: str, where: str) -> tuple[dict, int]:
    """The header of an open framed file (one read of HEAD bytes, a second for a longer header)."""
    header, offset = read_header(handle.read(HEAD), magic, kind, where)
    if not header:
        handle.seek(0)
        header, offset = read_header(handle.read(offset), magic, kind, where)
    return header, offset


def map_framed(path: str, magic: bytes, kind: str, where: str | None = None) -> tuple[dict, np.ndarray]:
    """A local framed file: its header, and its array memory-mapped read-only (header `count`)."""
    where = where or path
    with open(path, "rb") as handle:
        header, offset = read_head(handle, magic, kind, where)
    count = header.get("count", 0)
    if not isinstance(count, int) or count < 0:
        raise ValueError(f"{where}: {kind} header count must be a non-negative integer")
    array = np.memmap(path, "<i8", "r", offset=offset, shape=(count,)) if count else np.empty(0, np.int64)
    return header, array
