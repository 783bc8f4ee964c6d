"""Hugging Face `imagefolder` metadata files (`metadata.jsonl`, `metadata.csv`): the rows, keyed
by `file_name`, of the images of one folder.

A metadata file covers the images under its own folder (HF's rule: `file_name` is relative to
the metadata file's folder and may point into sub-folders). For the folder a worker reads, the
files in that folder and in each ancestor up to the source root are consulted, nearest first:
the nearest file with a row for an image gives it; in one folder `metadata.jsonl` comes before
`metadata.csv`. `file_name` is only ever matched against the listed images, so a row naming
`../x` or `/etc/passwd` matches nothing and opens nothing.

Cost: the first time a worker process meets a metadata file it streams it once whole (one line
in memory at a time) and keeps an index: per sub-folder, the byte spans of its rows (a run of
consecutive rows of one folder is one span, ~16 bytes: a file grouped by folder costs about 16
bytes a folder). Every later folder it covers reads only its own spans. The indexes live in a
per-process LRU of at most CACHE_FILES files and CACHE_SPANS spans in all; a file whose index
alone is bigger (rows of many folders interleaved) is not kept, and each folder streams it
again: time O(file) per folder, memory still one line. Memory per folder: its matched rows.

Safety as for images: a metadata file is read only if it is a regular file under the root, never
through a link (lstat, O_NOFOLLOW), of at most MAX_METADATA_BYTES, with lines of at most
MAX_LINE_BYTES. A refused file (or a `metadata.parquet`, which HF reads but this reader does not),
a line that is not JSON, a row without `file_name` are counted and become `caption_error` notes
on the samples they would have captioned, never rejects (the images are fine); a metadata file
is never a sample.
"""

from __future__ import annotations

import csv
import io
import os
import posixpath
import stat
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any, BinaryIO

from prx_core.sources.sample_metadata import parse_json_object

METADATA_FILENAMES = ("metadata.jsonl", "metadata.csv")
UNSUPPORTED_FILENAMES = ("metadata.parquet",)  # HF reads it too: here it is a note saying so, never silence
MAX_METADATA_BYTES = 4 << 30
MAX_LINE_BYTES = 1 << 20
CACHE_FILES = 64
CACHE_SPANS = 1 << 20  # ~16 MB of spans per worker process
Row = dict[str, Any]


@dataclass(frozen=True)
class MetadataFile:
    path: str  # as fsspec opens it
    rel: str  # relative to the source root: what notes name
    folder: str  # its folder relative to the root ('' for the root)
    stamp: str  # size and mtime (or ETag): a changed file is indexed again
    problem: str | None = None  # why it is not read


@dataclass
class _Index:
    spans: dict[str, array] | None = field(default_factory=dict)  # sub-folder -> [start, end, start, end...]
    header: list[str] | None = None  # a CSV file's columns
    count: int = 0
    bad: int = 0
    first_bad: str = ""
    last: str | None = None  # the sub-folder of the previous row (consecutive rows share a span)

    def add(self, sub: str, start: int, end: int) -> None:
        if self.spans is None:
            return
        if sub == self.last and self.spans[sub][-1] == start:
            self.spans[sub][-1] = end
            return
        self.spans.setdefault(sub, array("q")).extend((start, end))
        self.last, self.count = sub, self.count + 1
        if self.count > CACHE_SPANS:
            self.spans = None  # too interleaved to keep: later folders stream the file again

    def refuse(self, where: str, problem: str) -> None:
        self.bad += 1
        self.first_bad = self.first_bad or f"{where}: {problem}"


_CACHE: OrderedDict[tuple[str, str], _Index] = OrderedDict()


def covering_files(fs: Any, remote: bool, uri: str, rel: str, entries: dict[str, dict[str, Any]]) -> list[MetadataFile]:
    """The metadata files covering folder `rel` (relative to the root `uri`), nearest first: the
    folder's own from its listing `entries`, its ancestors' by one stat per file name (on S3 a
    HEAD request: 3 per ancestor)."""
    found, folder = [], rel
    while True:
        for name in METADATA_FILENAMES + UNSUPPORTED_FILENAMES:
            path = posixpath.join(uri, folder, name) if folder else posixpath.join(uri, name)
            entry = entries.get(name) if folder == rel else _info(fs, path)
            if entry is not None:
                meta = _checked(remote, uri, path, posixpath.join(folder, name), folder, entry)
                if name in UNSUPPORTED_FILENAMES:
                    meta = replace(meta, problem="not read: write the metadata as metadata.jsonl or metadata.csv")
                found.append(meta)
        if not folder:
            return found
        folder = posixpath.dirname(folder)


def folder_rows(fs: Any, remote: bool, meta: MetadataFile, rel: str, names: set[str]) -> tuple[dict[str, Row], _Index]:
    """The rows of `meta` for the images `names` of folder `rel`, and the file's index (its
    counts of refused lines). A file that cannot be read as a whole is an OSError/ValueError."""
    sub = "" if rel == meta.folder else rel[len(meta.folder) + 1:] if meta.folder else rel
    key = (meta.path, meta.stamp)
    index = _CACHE.get(key)
    with _open(fs, remote, meta.path) as handle:
        if index is None:
            index, rows = _build(handle, meta, sub, names)
            if index.spans is not None:
                _remember(key, index)
            return rows, index
        _CACHE.move_to_end(key)
        return _span_rows(handle, meta, index, sub, names), index


def _remember(key: tuple[str, str], index: _Index) -> None:
    _CACHE[key] = index
    while len(_CACHE) > CACHE_FILES or sum(i.count for i in _CACHE.values()) > CACHE_SPANS:
        _CACHE.popitem(last=False)


def _build(handle: BinaryIO, meta: MetadataFile, want: str, names: set[str]) -> tuple[_Index, dict[str, Row]]:
    index, rows = _Index(), {}
    for start, end, row in _rows(handle, meta, index, 0, MAX_METADATA_BYTES):
        where = _file_name(row.get("file_name"))
        if where is None:
            index.refuse(f"{meta.rel} row at byte {start}", "no usable file_name (a relative path)")
            continue
        index.add(where[0], start, end)
        if where[0] == want and where[1] in names:
            rows.setdefault(where[1], row)
    return index, rows


def _span_rows(handle: BinaryIO, meta: MetadataFile, index: _Index, want: str, names: set[str]) -> dict[str, Row]:
    rows: dict[str, Row] = {}
    spans = (index.spans or {}).get(want, array("q"))
    for i in range(0, len(spans), 2):
        for _, _, row in _rows(handle, meta, _Index(header=index.header), spans[i], spans[i + 1]):
            where = _file_name(row.get("file_name"))
            if where is not None and where[0] == want and where[1] in names:
                rows.setdefault(where[1], row)
    return rows


def _rows(handle: BinaryIO, meta: MetadataFile, index: _Index, start: int,
          end: int) -> Iterator[tuple[int, int, Row]]:
    """(start, end, row) of the rows between byte offsets `start` and `end`; refused lines are
    counted in `index`. A CSV file's header is read into `index.header` at offset 0."""
    handle.seek(start)
    if meta.rel.endswith(".csv"):
        yield from _csv_rows(handle, meta, index, start, end)
        return
    pos = start
    for line_start, line in _lines(handle, start, end):
        pos = line_start + (len(line) if line is not None else 0)
        if line is None:
            index.refuse(f"{meta.rel} line at byte {line_start}", f"longer than {MAX_LINE_BYTES} bytes")
            continue
        if not line.strip():
            continue
        obj, problem = parse_json_object(line)
        if problem:
            index.refuse(f"{meta.rel} line at byte {line_start}", problem)
            continue
        yield line_start, pos, obj


def _csv_rows(handle: BinaryIO, meta: MetadataFile, index: _Index, start: int,
              end: int) -> Iterator[tuple[int, int, Row]]:
    pos = [start]

    def text() -> Iterator[str]:
        for line_start, line in _lines(handle, start, end):
            if line is None:
                raise ValueError(f"{meta.rel}: a line at byte {line_start} is longer than {MAX_LINE_BYTES} bytes")
            pos[0] = line_start + len(line)
            yield line.decode("utf-8", errors="replace")

    reader = csv.reader(text())
    if index.header is None:
        index.header = [c.strip() for c in next(reader, [])]
        if index.header:
            index.header[0] = index.header[0].lstrip("\ufeff")
    while True:
        row_start = pos[0]
        try:
            values = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            index.refuse(f"{meta.rel} row at byte {row_start}", f"not CSV ({exc})")
            if pos[0] == row_start:
                return
            continue
        if values:
            yield row_start, pos[0], {k: v for k, v in zip(index.header, values) if v != ""}


def _lines(handle: BinaryIO, start: int, end: int) -> Iterator[tuple[int, bytes | None]]:
    """(offset, line) up to `end`; a line over MAX_LINE_BYTES is (offset, None), skipped unread."""
    pos = start
    while pos < end:
        line = handle.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            skipped = len(line)
            while line and not line.endswith(b"\n") and pos + skipped < end:
                line = handle.readline(1 << 20)
                skipped += len(line)
            yield pos, None
            pos += skipped
            continue
        yield pos, line
        pos += len(line)


def _file_name(value: Any) -> tuple[str, str] | None:
    """(sub-folder, base name) of a row's `file_name`, normalised; None for what names nothing
    inside the metadata file's folder (absolute, `..`, a URL, not text)."""
    if not isinstance(value, str) or not value or "://" in value:
        return None
    path = posixpath.normpath(value.replace("\\", "/"))
    if path.startswith("/") or path == ".." or path.startswith("../") or path == ".":
        return None
    return posixpath.dirname(path), posixpath.basename(path)


def _info(fs: Any, path: str) -> dict[str, Any] | None:
    try:
        return fs.info(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _checked(remote: bool, uri: str, path: str, rel: str, folder: str, entry: dict[str, Any]) -> MetadataFile:
    size = int(entry.get("size") or 0)
    stamp = f"{size}:{entry.get('ETag') or entry.get('LastModified') or entry.get('mtime')}"
    problem = None
    if entry.get("islink"):
        problem = "a symbolic link: not followed"
    elif entry.get("type") != "file":
        problem = f"not a regular file ({entry.get('type')})"
    elif size > MAX_METADATA_BYTES:
        problem = f"{size} bytes, over the limit of {MAX_METADATA_BYTES}"
    elif not remote and not _inside(uri, path):
        problem = "resolves outside the source root: not read"
    return MetadataFile(path, rel, folder, stamp, problem)


def _inside(uri: str, path: str) -> bool:
    root, where = os.path.realpath(uri), os.path.realpath(os.path.dirname(path))
    return where == root or where.startswith(root.rstrip(os.sep) + os.sep)


def _open(fs: Any, remote: bool, path: str) -> BinaryIO:
    """A metadata file for reading: never through a link, never a FIFO or a device (local files are
    opened with O_NOFOLLOW and checked with fstat: one swapped after the listing is refused)."""
    if remote:
        from fsspec.spec import AbstractBufferedFile

        handle = fs.open(path, "rb")  # s3fs's readline takes no size: buffered by io it does
        return io.BufferedReader(handle, 1 << 20) if isinstance(handle, AbstractBufferedFile) else handle
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError("not a regular file")
    return io.open(fd, "rb")
