"""Mosaic Data Shards for the corpus: one stream per (source, tier, bucket), written in chunks.

Layout `<root>/mds/<source>/<tier>/<w>x<h>/index.json` (version 2, ~128 MB shards, xxh64), read by
the PRX trainer with mosaicml-streaming's stock encodings, so nothing here may need a custom
decoder. A stream is written as chunk folders `<w>x<h>/<chunk>/` (each a complete MDS folder with
its own index.json, written by one worker, plus `prx-chunk.parquet`, what it holds) and published
by writing the stream's index.json, merged from its chunks' indexes the way streaming's
`merge_index` does (basenames prefixed by the chunk folder: one folder level, streaming#959).

Publishing never breaks a reader: a chunk folder's name is never reused for other bytes,
index.json is written last in one atomic step (os.replace, or one PUT), and chunk folders an
index no longer references are removed only by `prune_streams` after a retention window, so a
trainer holding the old index keeps reading the old, complete stream.
Reading back and verifying streams lives in `prx_core.shards.mds_read`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from streaming import MDSWriter
from streaming.base.format.mds.encodings import mds_encode

from prx_core.store.storage import filesystem_for, is_remote, join_uri, put_atomic

MDS_COLUMNS: dict[str, str] = {
    "image": "jpeg", "caption": "str", "original_caption": "str", "width": "int", "height": "int",
    "original_width": "int", "original_height": "int", "sample_id": "str", "source": "str",
}
SIZE_LIMIT = 1 << 27
HASHES = ["xxh64"]
INDEX_VERSION = 2
INDEX = "index.json"
CHUNK_RECORD = "prx-chunk.parquet"  # what a chunk holds, in order: ignored by streaming (not in index.json)
CHUNK_RECORD_SCHEMA = pa.schema([  # the stored samples in stream order (reason null), then the refused ones
    ("sample_id", pa.string()), ("content_id", pa.string()), ("source_key", pa.string()),
    ("image_sha256", pa.string()), ("reason", pa.string()), ("message", pa.string())])
RETENTION_SECONDS = 7 * 24 * 3600  # superseded chunks outlive the index that dropped them by this much
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
class ChunkSummary:
    """One written chunk folder of a stream."""

    name: str
    samples: int
    shards: int
    bytes: int  # shard bytes


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
    chunks: list[str] = field(default_factory=list)


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


def chunk_complete(folder: str, storage_options: dict | None = None) -> bool:
    """A chunk folder is complete once its index.json exists: it is written last."""
    fs = filesystem_for(folder, storage_options)
    fs.invalidate_cache()
    return fs.exists(join_uri(folder, INDEX))


def read_chunk_record(folder: str, storage_options: dict | None = None) -> pa.Table:
    """A complete chunk's record (CHUNK_RECORD_SCHEMA): stored samples in order, then rejects."""
    fs = filesystem_for(folder, storage_options)
    with fs.open(join_uri(folder, CHUNK_RECORD), "rb") as handle:
        return pq.read_table(handle)


def write_chunk(rows: Iterable[dict], folder: str, storage_options: dict | None = None,
                refused: Sequence[dict] = ()) -> ChunkSummary:
    """Write `rows` (MDS columns plus the encoded `jpeg`, in stream order) as one complete chunk
    folder at `folder`, which appears whole: locally by one rename, remotely with index.json
    uploaded last. A leftover incomplete folder of the same name (a crashed writer) is replaced.
    `refused` (sample_id, content_id, source_key, reason, message; it may fill while `rows` is
    consumed) is recorded after the stored samples, so a reused chunk still knows its rejects."""
    remote = is_remote(folder)
    parent = tempfile.gettempdir() if remote else os.path.dirname(folder)
    os.makedirs(parent, exist_ok=True)
    local = tempfile.mkdtemp(prefix=f".{os.path.basename(folder)}.", dir=parent)
    try:
        summary = _write_local_chunk(rows, local, os.path.basename(folder), refused)
        fs = filesystem_for(folder, storage_options)
        names = sorted(n for n in os.listdir(local) if n != INDEX)
        if remote:
            fs.put([os.path.join(local, n) for n in names], [join_uri(folder, n) for n in names])
            fs.put_file(os.path.join(local, INDEX), join_uri(folder, INDEX))
        else:
            for name in [*names, INDEX]:  # durable before visible: no empty shards after a power cut
                with open(os.path.join(local, name), "rb") as handle:
                    os.fsync(handle.fileno())
            if os.path.isdir(folder):
                shutil.rmtree(folder)
            os.rename(local, folder)
        return summary
    finally:
        shutil.rmtree(local, ignore_errors=True)


def _write_local_chunk(rows: Iterable[dict], local: str, name: str, refused: Sequence[dict]) -> ChunkSummary:
    writer = BytesJpegMDSWriter(columns=MDS_COLUMNS, out=local, hashes=HASHES, size_limit=SIZE_LIMIT, max_workers=1)
    record: dict[str, list[str | None]] = {c: [] for c in CHUNK_RECORD_SCHEMA.names}
    try:
        for row in rows:
            _check_jpeg(row)
            sample = {c: row[c] for c in MDS_COLUMNS if c != "image"}
            sample["image"] = row["jpeg"]
            writer.write(sample)
            for column, value in (("sample_id", row["sample_id"]), ("content_id", row.get("content_id")),
                                  ("source_key", row.get("source_key")), ("reason", None), ("message", None),
                                  ("image_sha256", hashlib.sha256(row["jpeg"]).hexdigest())):
                record[column].append(value)
        writer.finish()
    except BaseException:
        writer.cancel_future_jobs()
        raise
    stored = len(record["sample_id"])
    for row in refused:
        for column in CHUNK_RECORD_SCHEMA.names:
            record[column].append(row.get(column))
    pq.write_table(pa.table(record, schema=CHUNK_RECORD_SCHEMA), os.path.join(local, CHUNK_RECORD))
    return ChunkSummary(name, stored, len(writer.shards), sum(s["raw_data"]["bytes"] for s in writer.shards))


def _check_jpeg(row: dict) -> None:
    if not isinstance(row["jpeg"], (bytes, bytearray, memoryview)):
        raise TypeError(f"row {row['sample_id']!r}: `jpeg` must be the encoded bytes, "
                        "a PIL image would be re-encoded at quality 75")


def merge_chunk_indexes(chunks: Sequence[tuple[str, dict]]) -> dict:
    """The stream's index.json from its chunks' (folder name, index.json) in order: streaming's
    `merge_index` rule, every basename prefixed by its chunk folder."""
    shards = []
    for name, index in chunks:
        for shard in index["shards"]:
            shard = json.loads(json.dumps(shard))
            for key in ("raw_data", "zip_data", "raw_meta", "zip_meta"):
                if shard.get(key):
                    shard[key]["basename"] = f"{name}/{shard[key]['basename']}"
            shards.append(shard)
    return {"version": INDEX_VERSION, "shards": shards}


def publish_stream(uri: str, chunks: Sequence[str], storage_options: dict | None = None) -> int:
    """Make the stream at `uri` the concatenation of its complete chunk folders `chunks` (names, in
    order) by writing its index.json in one atomic step; returns its sample count."""
    fs = filesystem_for(uri, storage_options)
    fs.invalidate_cache()
    indexes = [(name, json.loads(fs.cat_file(join_uri(uri, name, INDEX)))) for name in chunks]
    merged = merge_chunk_indexes(indexes)
    put_atomic(fs, join_uri(uri, INDEX), json.dumps(merged, sort_keys=True).encode())
    fs.invalidate_cache()
    return sum(int(s["samples"]) for s in merged["shards"])


def unpublish_streams(root: str, source: str, keep: set[StreamKey], storage_options: dict | None = None) -> list[str]:
    """Remove the index.json of every published stream of `source` not in `keep` (a bucket that
    lost all its samples); its chunks stay for readers that hold the index until `prune_streams`."""
    fs = filesystem_for(_normalize(root), storage_options)
    gone = []
    for uri in list_streams(root, source, storage_options):
        tier, bucket = uri.rstrip("/").rsplit("/", 2)[-2:]
        size = BUCKET_FOLDER.fullmatch(bucket)
        if size and (int(tier), int(size[1]), int(size[2])) not in keep:
            fs.rm_file(join_uri(uri, INDEX))
            gone.append(uri)
    fs.invalidate_cache()
    return gone


def chunk_name(stream_key: StreamKey, digest: str) -> str:
    """A name no other content will ever get: derived from what the chunk holds."""
    return "c-" + hashlib.sha256(f"{stream_name(*stream_key)}\n{digest}".encode()).hexdigest()[:20]


def write_source_streams(rows: Iterable[dict], root: str, source: str, storage_options: dict | None = None,
                         grouped: bool = False) -> list[StreamSummary]:
    """Replace all MDS streams of `source` with `rows`, in one process: each stream becomes one
    chunk (named after its content, so a rerun of the same rows writes nothing), published once
    all are written; streams of the source absent from `rows` are unpublished. What the small
    corpora of tests and scripts use, and the reference the distributed stage is checked against.
    `grouped` declares rows arrive stream after stream (refused otherwise)."""
    if not source or "/" in source or source.startswith("."):
        raise ValueError(f"invalid source name {source!r}")
    root = _normalize(root)
    by_stream: dict[StreamKey, list[dict]] = {}
    last: StreamKey | None = None
    for row in rows:
        key = (int(row["tier"]), int(row["bucket_width"]), int(row["bucket_height"]))
        if grouped and key != last and key in by_stream:
            raise ValueError(f"rows are not grouped by stream: {stream_name(*key)} came back")
        if row["source"] != source or (row["width"], row["height"]) != key[1:]:
            raise ValueError(f"row {row.get('sample_id')!r}: source {row['source']!r} size "
                             f"{row['width']}x{row['height']} does not match {source}/{stream_name(*key)}")
        _check_jpeg(row)
        by_stream.setdefault(key, []).append(row)
        last = key
    summaries = []
    for key in sorted(by_stream):
        stream = by_stream[key]
        uri = stream_uri(root, source, *key)
        content = hashlib.sha256()
        for row in stream:
            content.update(f"{row['sample_id']}\t{hashlib.sha256(bytes(row['jpeg'])).hexdigest()}\t{row['caption']}\n".encode())
        name = chunk_name(key, content.hexdigest())
        folder = join_uri(uri, name)
        if not chunk_complete(folder, storage_options):
            write_chunk(stream, folder, storage_options)
        record = read_chunk_record(folder, storage_options).filter(pc.field("reason").is_null())
        info = json.loads(filesystem_for(folder, storage_options).cat_file(join_uri(folder, INDEX)))
        summaries.append(StreamSummary(source, *key, uri, record.num_rows, record["sample_id"].to_pylist(),
                                       record["image_sha256"].to_pylist(), len(info["shards"]),
                                       sum(s["raw_data"]["bytes"] for s in info["shards"]), [name]))
    for s in summaries:
        publish_stream(s.uri, s.chunks, storage_options)
    unpublish_streams(root, source, {(s.tier, s.width, s.height) for s in summaries}, storage_options)
    return summaries


@dataclass
class PruneReport:
    streams: int = 0
    removed: list[str] = field(default_factory=list)  # chunk folders and loose files, as URIs
    kept_recent: int = 0  # unreferenced, but younger than the retention


def prune_streams(root: str, retention_seconds: float = RETENTION_SECONDS, storage_options: dict | None = None,
                  source: str | None = None, now: float | None = None) -> PruneReport:
    """Delete what no published index.json references (superseded chunks, crashed writers'
    leftovers, pre-chunk shards) once it is older than `retention_seconds`. Never touches what an
    index references, so only readers older than the retention can lose their shards."""
    root = _normalize(root)
    fs = filesystem_for(root, storage_options)
    now = time.time() if now is None else now
    report = PruneReport()
    for stream in _stream_folders(fs, root, source):
        report.streams += 1
        referenced = set()
        if fs.exists(join_uri(stream, INDEX)):
            for shard in json.loads(fs.cat_file(join_uri(stream, INDEX)))["shards"]:
                referenced.add(shard["raw_data"]["basename"].split("/", 1)[0])
        newest: dict[str, float] = {}
        for path, info in fs.find(stream, detail=True).items():
            rel = path[len(fs._strip_protocol(stream).rstrip("/")) + 1:]
            if rel == INDEX:
                continue
            top = rel.split("/", 1)[0]
            newest[top] = max(newest.get(top, 0.0), _mtime(info))
        for top, mtime in sorted(newest.items()):
            if top in referenced:
                continue
            if now - mtime < retention_seconds:
                report.kept_recent += 1
                continue
            fs.rm(join_uri(stream, top), recursive=True)
            report.removed.append(join_uri(stream, top))
    fs.invalidate_cache()
    return report


def _stream_folders(fs: fsspec.AbstractFileSystem, root: str, source: str | None) -> list[str]:
    base = join_uri(root, "mds")
    fs.invalidate_cache()
    if not fs.exists(base):
        return []
    prefix = fs._strip_protocol(base).rstrip("/") + "/"
    found = set()
    for path in fs.find(join_uri(base, source) if source else base):
        parts = path[len(prefix):].split("/")
        if len(parts) >= 4 and not parts[0].startswith(".") and parts[1].isdigit() and BUCKET_FOLDER.fullmatch(parts[2]):
            found.add(join_uri(base, *parts[:3]))
    return sorted(found)


def _mtime(info: dict[str, Any]) -> float:
    value = info.get("mtime", info.get("LastModified", info.get("created")))
    if hasattr(value, "timestamp"):
        return float(value.timestamp())
    return float(value or 0.0)


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
