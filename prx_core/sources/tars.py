"""WebDataset tar shards: members `<key>.<ext>` grouped by key in archive order.

Bounded by construction: a member's size is checked from its header before anything is read
(an oversized image or caption makes its sample an `image_too_large` / `caption_too_large`
reject, the shard goes on), members the reader does not need are never read (a plain `.tar` is
opened seekable, so they are skipped by seeking; a `.tar.gz` / `.tgz` is gunzipped as a stream
in fixed-size blocks), and the member list tarfile keeps is cleared as it goes. A `.tar` that
is really gzip is refused with a clear error (the shard becomes one `unreadable_fragment`
reject): a shard is decompressed only when its name says so.
"""

from __future__ import annotations

import posixpath
import tarfile
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from prx_core.sources.catalog import SourceSpec
from prx_core.sources.records import (
    BAD_NAME,
    CAPTION_EXTENSIONS,
    CAPTION_TOO_LARGE,
    DUPLICATE_KEY,
    IMAGE_EXTENSIONS,
    IMAGE_TOO_LARGE,
    NOT_REGULAR_FILE,
    Batches,
    SeenKeys,
    decode_caption,
    is_utf8,
    printable_name,
    record,
    refused,
)
from prx_core.store.storage import filesystem_for

MAX_HEADER_BYTES = 1 << 20  # a PAX or GNU long-name header tarfile would read whole into memory
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")
GZIP_SUFFIXES = (".tar.gz", ".tgz")
GZIP_MAGIC = b"\x1f\x8b"


def is_shard(path: str) -> bool:
    return path.lower().endswith(TAR_SUFFIXES)


def member_key(name: str) -> tuple[str, str]:
    """(key, extension) of a member: its path up to the first dot of its base name, and the rest
    (`a/b.x.jpg` -> `a/b`, `x.jpg`). Distinct keys within a shard are distinct samples."""
    base = posixpath.basename(name)
    stem, _, ext = base.partition(".")
    return posixpath.join(posixpath.dirname(name), stem), ext.lower()


def read_webdataset(spec: SourceSpec, path: str, storage_options: dict[str, Any] | None) -> Iterator[pa.RecordBatch]:
    """The samples of one shard; the first image and the first caption member of a sample win."""
    fs = filesystem_for(path, storage_options)
    gzipped = path.lower().endswith(GZIP_SUFFIXES)
    with fs.open(path, "rb") as handle:
        if not gzipped and handle.read(2) == GZIP_MAGIC:
            raise ValueError(f"{path} is gzip-compressed but named .tar: rename it .tar.gz (or .tgz) to have it "
                             "read as a compressed shard")
        handle.seek(0)
        mode = "r|gz" if gzipped else "r:"
        with tarfile.open(fileobj=handle, mode=mode, encoding="utf-8", errors="surrogateescape",
                          tarinfo=_BoundedTarInfo) as tar:
            yield from _samples(spec, tar)


class _BoundedTarInfo(tarfile.TarInfo):
    """tarfile reads a PAX or GNU long-name header's data whole, whatever size it declares (a
    gzip shard can expand one to gigabytes): such a header over MAX_HEADER_BYTES ends the shard
    with a clear error (the samples stage records the rest as `unreadable_fragment`)."""

    def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        extended = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE,
                    tarfile.SOLARIS_XHDTYPE)
        if self.type in extended and self.size > MAX_HEADER_BYTES:
            raise tarfile.ReadError(f"extended header of {self.size} bytes (over {MAX_HEADER_BYTES}) "
                                    f"at offset {self.offset}")
        return super()._proc_member(tarfile_)


class _Sample:
    def __init__(self, key: str, problem: tuple[str, str] | None = None) -> None:
        self.key, self.problem = key, problem
        self.image: bytes | None = None
        self.caption: str | None = None

    def row(self) -> dict[str, Any]:
        if self.problem:
            return refused(printable_name(self.key), *self.problem)
        return record(self.key, self.image or b"", self.caption)


def _samples(spec: SourceSpec, tar: tarfile.TarFile) -> Iterator[pa.RecordBatch]:
    batches = Batches()
    seen = SeenKeys()
    current: _Sample | None = None
    while True:
        try:
            member = tar.next()
        except Exception:  # a corrupt or refused header: hand out what was read, lose only the rest
            if current is not None:
                yield from batches.add(current.row())
            yield from batches.flush()
            raise
        if member is None:
            break
        tar.members.clear()  # tarfile keeps every header otherwise: memory grows with the member count
        if member.isdir():
            continue
        key, ext = member_key(member.name)
        if current is None or current.key != key:
            if current is not None:
                yield from batches.add(current.row())
            current = _Sample(key)
            if not is_utf8(key):
                current.problem = (BAD_NAME, f"member {printable_name(member.name)!r}: name is not UTF-8")
            elif not seen.first(key):
                current.problem = (DUPLICATE_KEY, f"key {key!r} appears again in the shard: the first is kept")
        if current.problem:
            continue
        is_image, is_caption = ext in IMAGE_EXTENSIONS, ext in CAPTION_EXTENSIONS
        if not (is_image and current.image is None) and not (is_caption and current.caption is None):
            continue  # not needed: never read
        if not member.isfile():
            current.problem = (NOT_REGULAR_FILE, f"member {member.name!r} is a link or a special file")
            continue
        limit = spec.max_image_bytes if is_image else spec.max_caption_bytes
        if member.size > limit:
            reason = IMAGE_TOO_LARGE if is_image else CAPTION_TOO_LARGE
            current.problem = (reason, f"member {member.name!r} has {member.size} bytes, over the limit {limit}")
            continue
        handle = tar.extractfile(member)
        payload = handle.read(member.size) if handle is not None else b""  # checked: at most `limit`
        if is_image:
            current.image = payload
        else:
            current.caption = decode_caption(payload)
    if current is not None:
        yield from batches.add(current.row())
    yield from batches.flush()
