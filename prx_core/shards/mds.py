"""Mosaic Data Shards for the corpus: one stream per (source, tier, bucket), published whole.

Layout `<root>/mds/<source>/<tier>/<w>x<h>/` (index.json version 2, ~128 MB shards, xxh64), read
by the PRX trainer with mosaicml-streaming's stock encodings, so nothing here may need a custom
decoder. A source is rewritten by staging every stream and then publishing stream by stream: a
reader sees the old or the new stream, never a half-written one (see `write_source_streams`).
Reading back and verifying streams lives in `prx_core.shards.mds_read`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np
from streaming import MDSWriter
from streaming.base.format.mds.encodings import mds_encode

from prx_core.store.storage import filesystem_for, is_remote, join_uri

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
BUCKET_FOLDER = re.compile(r"(\d+)x(\d+)")
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


def stream_name(tier: int, width: int, height: int) -> str:
    return f"{int(tier)}/{int(width)}x{int(height)}"


def stream_uri(root: str, source: str, tier: int, width: int, height: int) -> str:
    return join_uri(_normalize(root), "mds", source, *stream_name(tier, width, height).split("/"))


def _normalize(root: str) -> str:
    return root.rstrip("/") if is_remote(root) else os.path.abspath(os.path.expanduser(root))


def list_files(fs: fsspec.AbstractFileSystem, base: str) -> list[str]:
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
    stale = [join_uri(uri, rel) for rel in list_files(fs, uri) if rel not in names]
    if stale:
        fs.rm(stale)
    fs.put([os.path.join(local, n) for n in names], [join_uri(uri, n) for n in names])
    fs.put_file(os.path.join(local, INDEX), index)
    fs.invalidate_cache()


def _remove_streams(fs: fsspec.AbstractFileSystem, root: str, source: str, keep: set[StreamKey]) -> None:
    """Remove every folder `<tier>/<w>x<h>` of the source not in `keep`, published or not."""
    base = join_uri(root, "mds", source)
    stale: set[tuple[str, str]] = set()
    for rel in list_files(fs, base):
        parts = rel.split("/")
        size = BUCKET_FOLDER.fullmatch(parts[1]) if len(parts) >= 3 and parts[0].isdigit() else None
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
        size = BUCKET_FOLDER.fullmatch(bucket)
        if not src.startswith(".") and tier.isdigit() and size:
            found.append(((src, int(tier), int(size[1]), int(size[2])), join_uri(base, src, tier, bucket)))
    return [uri for _, uri in sorted(found)]
