"""Publishing MDS streams: a stream's index.json merged from its chunks and written last, in one
atomic step; streams a source lost unpublished; the chunks an index drops recorded as superseded
(pruned a retention later: `prx_core.shards.mds.retention`); and the single-process writer that
tests, scripts and the distributed stage's reference use. See `prx_core.shards.mds.streams` for the
layout and the chunk writer."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence, Set
from dataclasses import dataclass, field

import pyarrow.compute as pc

from prx_core.shards.manifest_publish import publish_source_manifest
from prx_core.shards.mds.merged import join_merged, leave_merged
from prx_core.shards.mds.retention import note_superseded, referenced_chunks
from prx_core.shards.mds.streams import (
    BUCKET_FOLDER,
    INDEX,
    MEMBER_INDEX,
    StreamKey,
    check_jpeg,
    chunk_complete,
    list_streams,
    merge_indexes,
    read_chunk_record,
    read_stream_index,
    stream_name,
    stream_uri,
    write_chunk,
)
from prx_core.store.names import validate_source_name
from prx_core.store.storage import filesystem_for, join_uri, normalize_root, put_atomic


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


def publish_stream(uri: str, chunks: Sequence[str], storage_options: dict | None = None, index: str = INDEX) -> int:
    """Make the stream at `uri` the concatenation of its complete chunk folders `chunks` (names, in
    order) by writing its index.json (or a member's `index`, MEMBER_INDEX) in one atomic step;
    returns its sample count. The chunks the previous index referenced and this one does not are
    recorded as superseded first."""
    fs = filesystem_for(uri, storage_options)
    fs.invalidate_cache()
    merged = merge_indexes([(f"{name}/", json.loads(fs.cat_file(join_uri(uri, name, INDEX)))) for name in chunks])
    note_superseded(fs, uri, referenced_chunks(fs, uri), chunks)
    put_atomic(fs, join_uri(uri, index), json.dumps(merged, sort_keys=True).encode())
    fs.invalidate_cache()
    return sum(int(s["samples"]) for s in merged["shards"])


def publish_member(root: str, source: str, key: StreamKey, chunks: Sequence[str],
                   storage_options: dict | None = None) -> int:
    """Make `source`'s stream `key` (complete chunk folders `chunks`, in order) a member of its merged
    stream: its member.json written, its own index.json (if it was published alone) removed, then its
    chunks copied there and the member registered (`merged.join_merged`; `assemble_merged`
    publishes). Returns its sample count."""
    uri = stream_uri(root, source, *key)
    samples = publish_stream(uri, chunks, storage_options, index=MEMBER_INDEX)
    join_merged(root, source, key, chunks, storage_options)
    return samples


def unpublish_streams(root: str, source: str, keep: set[StreamKey], storage_options: dict | None = None) -> list[str]:
    """Remove the index.json of every published stream of `source` not in `keep` (a bucket that
    lost all its samples); its chunks, recorded as superseded now, stay for readers that hold the
    index until `prune_streams` removes them a retention later."""
    fs = filesystem_for(normalize_root(root), storage_options)
    gone = []
    for uri in list_streams(root, source, storage_options):
        tier, bucket = uri.rstrip("/").rsplit("/", 2)[-2:]
        size = BUCKET_FOLDER.fullmatch(bucket)
        if size and (int(tier), int(size[1]), int(size[2])) not in keep:
            note_superseded(fs, uri, referenced_chunks(fs, uri), ())
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
    validate_source_name(source)
    root = normalize_root(root)
    by_stream: dict[StreamKey, list[dict]] = {}
    last: StreamKey | None = None
    for row in rows:
        key = (int(row["tier"]), int(row["bucket_width"]), int(row["bucket_height"]))
        if grouped and key != last and key in by_stream:
            raise ValueError(f"rows are not grouped by stream: {stream_name(*key)} came back")
        if row["source"] != source or (row["width"], row["height"]) != key[1:]:
            raise ValueError(f"row {row.get('sample_id')!r}: source {row['source']!r} size "
                             f"{row['width']}x{row['height']} does not match {source}/{stream_name(*key)}")
        check_jpeg(row)
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
    publish_source_manifest(root, source, storage_options)
    return summaries


@dataclass
class StreamReport:
    """A stream as a publish left it."""

    tier: int
    width: int
    height: int
    uri: str
    samples: int
    chunks: list[str]
    shards: int
    bytes: int
    rejected: int = 0  # rows routed to this stream that could not be stored (no caption, decode error)
    merged: bool = False  # a member of `_merged/<tier>/<w>x<h>` (training.small_streams: merge), not published alone

    @property
    def name(self) -> str:
        return stream_name(self.tier, self.width, self.height)


def publish_source(root: str, source: str, chunks: Sequence[tuple[StreamKey, str, int, int]],
                   storage_options: dict | None = None, members: Set[StreamKey] = frozenset()) -> list[StreamReport]:
    """Publish every stream of `source` from its chunks, given as (stream, chunk folder, rows
    stored, rows refused) in stream order; chunks that stored nothing are left out. The streams in
    `members` join their merged streams instead (`prx_core.shards.mds.merged`); the source's streams
    with no stored row any more are unpublished, and its former members leave."""
    by_stream: dict[StreamKey, list[str]] = {}
    rejected: dict[StreamKey, int] = {}
    for key, name, rows, refused in chunks:
        rejected[key] = rejected.get(key, 0) + refused
        if rows:
            by_stream.setdefault(key, []).append(name)
    fs = filesystem_for(normalize_root(root), storage_options)
    reports = []
    for key in sorted(by_stream):
        uri = stream_uri(root, source, *key)
        if key in members:
            samples = publish_member(root, source, key, by_stream[key], storage_options)
        else:
            samples = publish_stream(uri, by_stream[key], storage_options)
        shards = json.loads(read_stream_index(fs, uri))["shards"]
        reports.append(StreamReport(*key, uri, samples, by_stream[key], len(shards),
                                    sum(int(s["raw_data"]["bytes"]) for s in shards), rejected[key], key in members))
    unpublish_streams(root, source, set(by_stream) - set(members), storage_options)
    left = leave_merged(root, source, set(by_stream) & set(members), storage_options)
    # its streams (and merged streams it is in) refused until skip_lists runs
    publish_source_manifest(root, source, storage_options, merged=left)
    return reports
