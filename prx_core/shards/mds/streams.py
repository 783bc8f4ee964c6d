"""Mosaic Data Shards for the corpus: one stream per (source, tier, bucket), written in chunks.

Layout `<root>/mds/<source>/<tier>/<w>x<h>/index.json` (version 2, ~128 MB shards, xxh64), read by
the PRX trainer with mosaicml-streaming's stock encodings, with one exception: the text-latent
columns (`latent_caption_<preset>`, present only when text latents are configured) use the `bf16`
encoding PRX's trainer registers itself; `prx_core.shards.mds.encodings` registers the same bytes under
that name for our writer and loader (their masks, `attention_mask_caption_<preset>`, use the stock
`ndarray:uint8`). A stream is written as chunk folders `<w>x<h>/<chunk>/` (each a complete MDS
folder with its own index.json, written by one worker, plus `prx-chunk.parquet`, what it holds)
and published by writing the stream's index.json, merged from its chunks' indexes the way
streaming's `merge_index` does (basenames prefixed by the chunk folder: one folder level,
streaming#959).

Publishing never breaks a reader: a chunk folder's name is never reused for other bytes,
index.json is written last in one atomic step (os.replace, or one PUT), and chunk folders an
index no longer references are removed only by `prune_streams` after a retention window, so a
trainer holding the old index keeps reading the old, complete stream.
Reading back and verifying streams lives in `prx_core.shards.mds.read`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from prx_core.store.names import validate_source_name
from prx_core.store.storage import filesystem_for, is_remote, join_uri, naming_full_disk, normalize_root

MDS_COLUMNS: dict[str, str] = {
    "image": "jpeg", "caption": "str", "original_caption": "str", "width": "int", "height": "int",
    "original_width": "int", "original_height": "int", "sample_id": "str", "source": "str",
}
SIZE_LIMIT = 1 << 27
HASHES = ["xxh64"]
INDEX_VERSION = 2
INDEX = "index.json"
MEMBER_INDEX = "member.json"  # a small stream merged into `_merged` (prx_core.shards.mds.merged): no trainer lists it
CHUNK_RECORD = "prx-chunk.parquet"  # what a chunk holds, in order: ignored by streaming (not in index.json)
CHUNK_RECORD_SCHEMA = pa.schema([  # the stored samples in stream order (reason null), then the refused ones
    ("sample_id", pa.string()), ("content_id", pa.string()), ("source_key", pa.string()),
    ("image_sha256", pa.string()), ("reason", pa.string()), ("message", pa.string()),
    # what the sample's caption is keyed by (prx_core.models.caption_keys): its labels are looked
    # up by it; a record written before caption keys existed reads as its content ids
    ("caption_key", pa.string())])
BUCKET_FOLDER = re.compile(r"(\d+)x(\d+)")
StreamKey = tuple[int, int, int]  # (tier, width, height)


@dataclass
class ChunkSummary:
    """One written chunk folder of a stream."""

    name: str
    samples: int
    shards: int
    bytes: int  # shard bytes


def stream_name(tier: int, width: int, height: int) -> str:
    return f"{int(tier)}/{int(width)}x{int(height)}"


def stream_uri(root: str, source: str, tier: int, width: int, height: int) -> str:
    return join_uri(normalize_root(root), "mds", validate_source_name(source), *stream_name(tier, width, height).split("/"))


def stream_key_of(uri: str) -> StreamKey:
    """(tier, width, height) of a stream URI ending `<tier>/<w>x<h>`, as `list_streams` returns them."""
    tier, bucket = uri.rstrip("/").rsplit("/", 2)[-2:]
    width, height = bucket.split("x")
    return int(tier), int(width), int(height)


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
        # pre_buffer reads on Arrow IO threads that can outlive the file object: one finishing at
        # interpreter exit aborts the process (a build printed "ok" and then died of SIGABRT)
        record = pq.read_table(handle, pre_buffer=False)
    if "caption_key" not in record.column_names:  # captions were keyed by content then
        record = record.append_column("caption_key", record["content_id"])
    return record


def write_chunk(rows: Iterable[dict], folder: str, storage_options: dict | None = None,
                refused: Sequence[dict] = (), columns: Mapping[str, str] | None = None) -> ChunkSummary:
    """Write `rows` (the MDS columns plus the encoded `jpeg`, in stream order) as one complete chunk
    folder at `folder`, which appears whole: locally by one rename, remotely with index.json
    uploaded last. A leftover incomplete folder of the same name (a crashed writer) is replaced.
    `refused` (sample_id, content_id, source_key, reason, message; it may fill while `rows` is
    consumed) is recorded after the stored samples, so a reused chunk still knows its rejects.
    `columns` (name -> MDS encoding, default MDS_COLUMNS) adds columns such as the text latents
    (`prx_core.shards.mds.encodings.latent_columns`), each taken from the rows as is."""
    columns = dict(MDS_COLUMNS if columns is None else columns)
    if missing := [c for c in MDS_COLUMNS if columns.get(c) != MDS_COLUMNS[c]]:
        raise ValueError(f"columns must extend MDS_COLUMNS (PRX reads them): {missing} missing or re-encoded")
    remote = is_remote(folder)
    parent = tempfile.gettempdir() if remote else os.path.dirname(folder)
    with naming_full_disk(parent):
        os.makedirs(parent, exist_ok=True)
        local = tempfile.mkdtemp(prefix=f".{os.path.basename(folder)}.", dir=parent)
    try:
        with naming_full_disk(local if remote else folder):
            summary = _write_local_chunk(rows, local, os.path.basename(folder), refused, columns)
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


def _write_local_chunk(rows: Iterable[dict], local: str, name: str, refused: Sequence[dict],
                       columns: dict[str, str]) -> ChunkSummary:
    from prx_core.shards.mds.writer import MDSShardWriter

    writer = MDSShardWriter(columns, local, HASHES, SIZE_LIMIT)
    record: dict[str, list[str | None]] = {c: [] for c in CHUNK_RECORD_SCHEMA.names}
    for row in rows:
        check_jpeg(row)
        sample = {c: row[c] for c in columns if c != "image"}
        sample["image"] = row["jpeg"]
        writer.write(sample)
        for column, value in (("sample_id", row["sample_id"]), ("content_id", row.get("content_id")),
                              ("source_key", row.get("source_key")), ("reason", None), ("message", None),
                              ("caption_key", row.get("caption_key", row.get("content_id"))),
                              ("image_sha256", hashlib.sha256(row["jpeg"]).hexdigest())):
            record[column].append(value)
    writer.finish()
    stored = len(record["sample_id"])
    for row in refused:
        for column in CHUNK_RECORD_SCHEMA.names:
            record[column].append(row.get(column))
    pq.write_table(pa.table(record, schema=CHUNK_RECORD_SCHEMA), os.path.join(local, CHUNK_RECORD))
    return ChunkSummary(name, stored, len(writer.shards), sum(s["raw_data"]["bytes"] for s in writer.shards))


def check_jpeg(row: dict) -> None:
    """Refuse a row whose `jpeg` is not encoded bytes: the shard writer would re-encode an image."""
    if not isinstance(row["jpeg"], (bytes, bytearray, memoryview)):
        raise TypeError(f"row {row['sample_id']!r}: `jpeg` must be the encoded bytes, "
                        "a PIL image would be re-encoded at quality 75")


def list_streams(root: str, source: str | None = None, storage_options: dict | None = None,
                 members: bool = False) -> list[str]:
    """Published stream URIs (`<tier>/<w>x<h>` folders holding index.json), staging excluded; with
    `members` also the source's streams merged into `_merged` (holding member.json)."""
    base = join_uri(normalize_root(root), "mds")
    fs = filesystem_for(base, storage_options)
    fs.invalidate_cache()
    prefix = fs._strip_protocol(base).rstrip("/") + "/"
    found = []
    pattern = join_uri(base, validate_source_name(source) if source is not None else "*", "*", "*", INDEX)
    paths = fs.glob(pattern) + (fs.glob(pattern.removesuffix(INDEX) + MEMBER_INDEX) if members else [])
    for path in paths:
        src, tier, bucket, _ = path[len(prefix):].split("/")
        size = BUCKET_FOLDER.fullmatch(bucket)
        if not src.startswith(".") and tier.isdigit() and size:
            found.append(((src, int(tier), int(size[1]), int(size[2])), join_uri(base, src, tier, bucket)))
    return [uri for _, uri in sorted(set(found))]


def merge_indexes(parts: Sequence[tuple[str, dict]]) -> dict:
    """One index.json from parts' (prefix, index.json) in order, every basename prefixed: a stream
    from its chunks (`<chunk>/`, streaming's `merge_index` rule) or a merged stream from its
    members (`<source>.`, their basenames already `<chunk>/...`)."""
    shards = []
    for prefix, index in parts:
        for shard in index["shards"]:
            shard = json.loads(json.dumps(shard))
            for key in ("raw_data", "zip_data", "raw_meta", "zip_meta"):
                if shard.get(key):
                    shard[key]["basename"] = f"{prefix}{shard[key]['basename']}"
            shards.append(shard)
    return {"version": INDEX_VERSION, "shards": shards}


def read_stream_index(fs: fsspec.AbstractFileSystem, uri: str) -> bytes:
    """A stream's index bytes: its index.json, or a member's member.json (`list_streams(members=True)`)."""
    try:
        return fs.cat_file(join_uri(uri, INDEX))
    except FileNotFoundError:
        return fs.cat_file(join_uri(uri, MEMBER_INDEX))
