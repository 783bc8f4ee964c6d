"""Mosaic Data Shards for the corpus: one stream per (source, tier, bucket), published whole.

Layout `<root>/mds/<source>/<tier>/<w>x<h>/` (index.json version 2, ~128 MB shards, xxh64), read
by the PRX trainer with mosaicml-streaming's stock encodings, so nothing here may need a custom
decoder. A source is rewritten by staging every stream and then publishing stream by stream: a
reader sees the old or the new stream, never a half-written one (see `write_source_streams`).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
from streaming import MDSWriter
from streaming.base.format import reader_from_json
from streaming.base.format.mds.encodings import mds_decode, mds_encode
from streaming.base.hashing import get_hash

from prx_core.jpeg_quality import estimate_jpeg_quality
from prx_core.storage import filesystem_for, is_remote, join_uri

MDS_COLUMNS: dict[str, str] = {
    "image": "jpeg", "caption": "str", "original_caption": "str", "width": "int", "height": "int",
    "original_width": "int", "original_height": "int", "sample_id": "str", "source": "str",
}
SIZE_LIMIT = 1 << 27
HASHES = ["xxh64"]
INDEX_VERSION = 2
INDEX = "index.json"
STAGING = ".staging"
_STAGING_TOKEN = re.compile(r"[0-9a-f]{32}")
_BUCKET = re.compile(r"(\d+)x(\d+)")
StreamKey = tuple[int, int, int]  # (tier, width, height)


class BytesJpegMDSWriter(MDSWriter):
    """An MDSWriter whose `jpeg` columns take already-encoded JPEG bytes and store them verbatim.

    Why: streaming's `jpeg` encoder passes bytes through only for a `JpegImageFile` opened from a
    named file; any other PIL image (one decoded from bytes included) is re-saved at Pillow's
    default quality 75, silently replacing the pipeline's q92 encode. The stock `jpeg` decoder is
    `Image.open(BytesIO(data))`, so verbatim bytes are exactly what readers expect and index.json
    still says `jpeg`. Mirrors `MDSWriter.encode_sample` of streaming 0.13; PIL values still go
    through the stock encoder.
    """

    def encode_sample(self, sample: dict[str, Any]) -> bytes:
        sizes: list[int] = []
        data: list[bytes] = []
        for key, encoding, size in zip(self.column_names, self.column_encodings, self.column_sizes):
            value = sample[key]
            if encoding == "jpeg" and isinstance(value, (bytes, bytearray, memoryview)):
                datum = bytes(value)
                if not datum.startswith(b"\xff\xd8\xff"):
                    raise ValueError(f"column {key!r}: bytes are not a JPEG (no SOI marker)")
            else:
                datum = mds_encode(encoding, value)
            if size is None:
                sizes.append(len(datum))
            elif size != len(datum):
                raise KeyError(f"column {key!r}: {len(datum)} bytes, encoding {encoding} needs {size}")
            data.append(datum)
        return np.array(sizes, np.uint32).tobytes() + b"".join(data)


@dataclass
class StreamSummary:
    source: str
    tier: int
    width: int
    height: int
    uri: str
    count: int
    sample_ids: list[str]  # in index order
    image_sha256: list[str]  # of the exact stored bytes, aligned with sample_ids
    shards: int
    bytes: int  # shard bytes, index.json excluded


@dataclass
class StreamReport:
    uri: str
    count: int
    hashes_ok: bool
    bytes_identical: bool | None  # None when no expected hashes were given
    decoded_ok: bool
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def stream_name(tier: int, width: int, height: int) -> str:
    return f"{int(tier)}/{int(width)}x{int(height)}"


def stream_uri(root: str, source: str, tier: int, width: int, height: int) -> str:
    return join_uri(_normalize(root), "mds", source, *stream_name(tier, width, height).split("/"))


def _normalize(root: str) -> str:
    return root.rstrip("/") if is_remote(root) else os.path.abspath(os.path.expanduser(root))


def _find(fs: fsspec.AbstractFileSystem, base: str) -> list[str]:
    """Every file under `base`, relative to it (none when it does not exist); cache bypassed."""
    fs.invalidate_cache()
    if not fs.exists(base):
        return []
    prefix = fs._strip_protocol(base).rstrip("/") + "/"
    return [path[len(prefix):] for path in fs.find(base)]


def _staging_parent(root: str) -> str:
    """Next to the streams locally (same filesystem, so publishing is a rename); in TMPDIR for a
    remote root, keyed by the root so two corpora never clean each other's staging."""
    if is_remote(root):
        digest = hashlib.blake2s(root.encode(), digest_size=8).hexdigest()
        return os.path.join(tempfile.gettempdir(), "prx-mds-staging", digest)
    return join_uri(root, "mds", STAGING)


def _remove_crashed_staging(parent: str, source: str) -> None:
    """Leftovers of an earlier crashed write of this source (only its own: others may be live)."""
    if not os.path.isdir(parent):
        return
    for name in os.listdir(parent):
        if name.startswith(f"{source}-") and _STAGING_TOKEN.fullmatch(name[len(source) + 1:]):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def write_source_streams(
    rows: Iterable[dict], root: str, source: str, storage_options: dict | None = None, grouped: bool = False
) -> list[StreamSummary]:
    """Replace all MDS streams of `source` with `rows` (stored in arrival order per stream).

    Every stream is fully written to staging first; only then is each one published (local:
    directory exchange; remote: old index.json removed, shards uploaded, index.json last), then
    the source's streams absent from the new set are removed. Other sources are never touched.
    Memory: each open stream buffers up to one shard (SIZE_LIMIT) before flushing it; with
    `grouped` (rows arrive stream after stream) a stream is finished when the next begins, so
    only one buffer is ever held.
    """
    if not source or "/" in source or source.startswith("."):
        raise ValueError(f"invalid source name {source!r}")
    root = _normalize(root)
    parent = _staging_parent(root)
    _remove_crashed_staging(parent, source)
    staging = os.path.join(parent, f"{source}-{uuid.uuid4().hex}")
    fs = filesystem_for(root, storage_options)
    try:
        summaries = _write_staged(rows, root, source, staging, grouped)
        for s in summaries:
            local = os.path.join(staging, stream_name(s.tier, s.width, s.height))
            if is_remote(root):
                _publish_remote(fs, local, s.uri)
            else:
                _publish_local(local, s.uri)
        _remove_streams(fs, root, source, keep={(s.tier, s.width, s.height) for s in summaries})
        return summaries
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if not is_remote(root) and os.path.isdir(parent) and not os.listdir(parent):
            os.rmdir(parent)


def _finish(writer: BytesJpegMDSWriter, summary: StreamSummary) -> None:
    writer.finish()
    summary.shards = len(writer.shards)
    summary.bytes = sum(s["raw_data"]["bytes"] for s in writer.shards)


def _write_staged(rows: Iterable[dict], root: str, source: str, staging: str, grouped: bool) -> list[StreamSummary]:
    writers: dict[StreamKey, BytesJpegMDSWriter] = {}
    summaries: dict[StreamKey, StreamSummary] = {}
    current: StreamKey | None = None
    try:
        for row in rows:
            key = (int(row["tier"]), int(row["bucket_width"]), int(row["bucket_height"]))
            if grouped and key != current:
                if key in summaries:
                    raise ValueError(f"rows are not grouped by stream: {stream_name(*key)} came back")
                if current is not None:
                    _finish(writers.pop(current), summaries[current])
                current = key
            if row["source"] != source or (row["width"], row["height"]) != key[1:]:
                raise ValueError(f"row {row.get('sample_id')!r}: source {row['source']!r} size "
                                 f"{row['width']}x{row['height']} does not match {source}/{stream_name(*key)}")
            if not isinstance(row["jpeg"], (bytes, bytearray, memoryview)):
                raise TypeError(f"row {row['sample_id']!r}: `jpeg` must be the encoded bytes, "
                                "a PIL image would be re-encoded at quality 75")
            if key not in writers:
                writers[key] = BytesJpegMDSWriter(
                    columns=MDS_COLUMNS, out=os.path.join(staging, stream_name(*key)),
                    hashes=HASHES, size_limit=SIZE_LIMIT, max_workers=1)
                summaries[key] = StreamSummary(source, *key, stream_uri(root, source, *key), 0, [], [], 0, 0)
            sample = {c: row[c] for c in MDS_COLUMNS if c != "image"}
            sample["image"] = row["jpeg"]
            writers[key].write(sample)
            summary = summaries[key]
            summary.count += 1
            summary.sample_ids.append(row["sample_id"])
            summary.image_sha256.append(hashlib.sha256(row["jpeg"]).hexdigest())
        for key, writer in writers.items():
            _finish(writer, summaries[key])
    except BaseException:
        for writer in writers.values():
            writer.cancel_future_jobs()
        raise
    return [summaries[k] for k in sorted(summaries)]


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    """Swap two directories in one atomic step (Linux renameat2); False where unsupported."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def _publish_local(staged: str, final: str) -> None:
    """New streams appear by one rename; existing ones are exchanged atomically with the staged
    copy (fallback: rename aside, then in: a moment with no stream, never a partial one)."""
    for name in os.listdir(staged):  # durable before visible: no empty shards after a power cut
        with open(os.path.join(staged, name), "rb") as handle:
            os.fsync(handle.fileno())
    os.makedirs(os.path.dirname(final), exist_ok=True)
    if not os.path.isdir(final):
        os.rename(staged, final)
    elif not _exchange(staged, final):
        aside = f"{staged}.old"
        os.rename(final, aside)
        os.rename(staged, final)
    # after an exchange `staged` holds the old stream; it goes with the staging folder


def _publish_remote(fs: fsspec.AbstractFileSystem, local: str, uri: str) -> None:
    """Object stores have no rename: hide the stream (index.json first), replace its objects,
    then make it visible again by writing index.json last."""
    index = join_uri(uri, INDEX)
    names = sorted(n for n in os.listdir(local) if n != INDEX)
    fs.invalidate_cache()
    if fs.exists(index):
        fs.rm_file(index)
    stale = [join_uri(uri, rel) for rel in _find(fs, uri) if rel not in names]
    if stale:
        fs.rm(stale)
    fs.put([os.path.join(local, n) for n in names], [join_uri(uri, n) for n in names])
    fs.put_file(os.path.join(local, INDEX), index)
    fs.invalidate_cache()


def _remove_streams(fs: fsspec.AbstractFileSystem, root: str, source: str, keep: set[StreamKey]) -> None:
    """Remove every folder `<tier>/<w>x<h>` of the source not in `keep`, published or not."""
    base = join_uri(root, "mds", source)
    stale: set[tuple[str, str]] = set()
    for rel in _find(fs, base):
        parts = rel.split("/")
        size = _BUCKET.fullmatch(parts[1]) if len(parts) >= 3 and parts[0].isdigit() else None
        if size is not None and (int(parts[0]), int(size[1]), int(size[2])) not in keep:
            stale.add((parts[0], parts[1]))
    for tier, bucket in sorted(stale):
        folder = join_uri(base, tier, bucket)
        if fs.exists(join_uri(folder, INDEX)):
            fs.rm_file(join_uri(folder, INDEX))  # unpublish first
        if fs.exists(folder):
            fs.rm(folder, recursive=True)
    if not is_remote(root) and os.path.isdir(base):
        for tier in os.listdir(base):
            if os.path.isdir(os.path.join(base, tier)) and not os.listdir(os.path.join(base, tier)):
                os.rmdir(os.path.join(base, tier))
        if not os.listdir(base):
            os.rmdir(base)
    fs.invalidate_cache()


def list_streams(root: str, source: str | None = None, storage_options: dict | None = None) -> list[str]:
    """Published stream URIs (`<tier>/<w>x<h>` folders holding index.json), staging excluded."""
    base = join_uri(_normalize(root), "mds")
    fs = filesystem_for(base, storage_options)
    fs.invalidate_cache()
    prefix = fs._strip_protocol(base).rstrip("/") + "/"
    found = []
    for path in fs.glob(join_uri(base, source or "*", "*", "*", INDEX)):
        src, tier, bucket, _ = path[len(prefix):].split("/")
        size = _BUCKET.fullmatch(bucket)
        if not src.startswith(".") and tier.isdigit() and size:
            found.append(((src, int(tier), int(size[1]), int(size[2])), join_uri(base, src, tier, bucket)))
    return [uri for _, uri in sorted(found)]


@contextmanager
def _local_copy(uri: str, storage_options: dict | None) -> Iterator[str]:
    """A local folder holding the stream: itself, or a temporary download of a remote one."""
    if not is_remote(uri):
        yield os.path.abspath(uri)
        return
    fs = filesystem_for(uri, storage_options)
    tmp = tempfile.mkdtemp(prefix="prx-mds-read-")
    try:
        names = [rel for rel in _find(fs, uri) if "/" not in rel]
        fs.get([join_uri(uri, n) for n in names], [os.path.join(tmp, n) for n in names])
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _iter_raw_rows(local: str, index: dict) -> Iterator[tuple[dict, dict[str, bytes]]]:
    """(shard info, raw column bytes) per sample, located by streaming's own MDSReader."""
    for info in index["shards"]:
        reader = reader_from_json(local, "", info)
        for idx in range(reader.samples):
            data, pos, sizes = reader.get_sample_data(idx), 0, []
            for size in reader.column_sizes:
                if size is None:
                    size, pos = int(np.frombuffer(data[pos:pos + 4], np.uint32)[0]), pos + 4
                sizes.append(size)
            ends = np.cumsum([pos, *sizes]).tolist()
            yield info, {n: data[a:b] for n, a, b in zip(reader.column_names, ends, ends[1:])}


def read_stream_rows(uri: str, columns: list[str] | None = None,
                     storage_options: dict | None = None) -> list[dict[str, Any]]:
    """Rows in index order; `image` stays the raw stored JPEG bytes, other columns decoded."""
    with _local_copy(uri, storage_options) as local:
        with open(os.path.join(local, INDEX)) as handle:
            index = json.load(handle)
        out = []
        for info, raw in _iter_raw_rows(local, index):
            encodings = dict(zip(info["column_names"], info["column_encodings"]))
            out.append({k: v if encodings[k] == "jpeg" else mds_decode(encodings[k], v)
                        for k, v in raw.items() if columns is None or k in columns})
        return out


def verify_stream(uri: str, storage_options: dict | None = None, expected_sha256: list[str] | None = None,
                  expected_quality: int | None = None) -> StreamReport:
    """Read a published stream back and check it against index.json and the expected images.

    Checks the xxh64 of every shard (a local `Stream` never does), the column encodings, that each
    stored image's sha256 is the expected one (byte identity with the pipeline's encode) and that
    it decodes, through the stock `jpeg` decoder, to the row's and the folder's (width, height).
    `expected_quality` also checks each image's estimated JPEG quality (a q75 re-encode shows up
    even without expected hashes); a mismatch is listed in `problems`.
    """
    report = StreamReport(uri, 0, True, None, True)
    bucket = _BUCKET.fullmatch(uri.rstrip("/").rsplit("/", 1)[-1])
    shas: list[str] = []
    with _local_copy(uri, storage_options) as local:
        try:
            with open(os.path.join(local, INDEX)) as handle:
                index = json.load(handle)
        except (OSError, ValueError) as exc:
            return StreamReport(uri, 0, False, False if expected_sha256 is not None else None, False,
                                [f"index.json unreadable: {exc}"])
        if index.get("version") != INDEX_VERSION:
            report.problems.append(f"index version {index.get('version')} != {INDEX_VERSION}")
        for info in index["shards"]:
            raw = info["raw_data"]
            if dict(zip(info["column_names"], info["column_encodings"])) != MDS_COLUMNS:
                report.problems.append(f"{raw['basename']}: column encodings differ from MDS_COLUMNS")
            path = os.path.join(local, raw["basename"])
            data = Path(path).read_bytes() if os.path.isfile(path) else b""
            if get_hash("xxh64", data) != raw["hashes"].get("xxh64"):
                report.hashes_ok = False
                report.problems.append(f"{raw['basename']}: xxh64 does not match index.json")
        try:
            for info, row in _iter_raw_rows(local, index):
                shas.append(hashlib.sha256(row["image"]).hexdigest())
                problem = _check_image(row, bucket, expected_quality)
                if problem:
                    report.decoded_ok = False
                    report.problems.append(f"sample {len(shas) - 1} ({info['raw_data']['basename']}): {problem}")
        except Exception as exc:  # a corrupted shard may break the reader itself
            report.decoded_ok = False
            report.problems.append(f"reading samples failed: {type(exc).__name__}: {exc}")
        report.count = len(shas)
        if report.count != sum(info["samples"] for info in index["shards"]):
            report.problems.append(f"read {report.count} samples, index.json says otherwise")
    if expected_sha256 is not None:
        report.bytes_identical = shas == list(expected_sha256)
        if not report.bytes_identical:
            wrong = [i for i, (a, b) in enumerate(zip(shas, expected_sha256)) if a != b]
            report.problems.append(f"stored image bytes differ from expected ({len(shas)} stored, "
                                   f"{len(expected_sha256)} expected, first mismatches {wrong[:5]})")
    return report


def _check_image(row: dict[str, bytes], bucket: re.Match | None, quality: int | None) -> str | None:
    try:
        width, height = mds_decode("int", row["width"]), mds_decode("int", row["height"])
        with mds_decode("jpeg", row["image"]) as image:
            image.load()
            size, fmt = image.size, image.format
    except Exception as exc:
        return f"does not decode: {type(exc).__name__}: {exc}"
    if fmt != "JPEG" or size != (width, height):
        return f"decodes to {fmt} {size}, row says {(width, height)}"
    if bucket is not None and size != (int(bucket[1]), int(bucket[2])):
        return f"decodes to {size}, stream bucket is {bucket[0]}"
    if quality is not None and estimate_jpeg_quality(row["image"]) != quality:
        return f"JPEG quality {estimate_jpeg_quality(row['image'])}, expected {quality}"
    return None
