"""Republishing one MDS stream without some of its samples: what a takedown (`opt-out
--delete-bytes`) and a stream past 10% skipped (`rewrite-stream`) both need.

Only the chunks holding a dropped position are rewritten: each becomes a new chunk folder
(named after the chunk it replaces and the samples it dropped, so a rerun reuses it and the name
never holds other bytes), its stored JPEGs copied verbatim, never re-encoded. The stream's
index.json is then replaced in one atomic step (`publish_stream`: the chunks it drops are recorded
as superseded, removed by `prune_streams` a retention later, or at once with
`remove_superseded_now`). The stream's skip-lists are remapped to the new positions (the dropped
samples leave them) and get a fresh completion record bound to the new index; the stream's
`mds_index` rows are replaced in one commit, and the lists' completion record is written last.
A crash in between leaves a stream the loader refuses (its record is not for the new index) and
this function refuses too: materializing `mds_shards` and `skip_lists` for the source makes it
whole again. The caller holds the `mds_shards` and `skip_lists` locks of the source. Memory: one
chunk's record and one sample at a time, plus the stream's skip positions (what the loader holds
too).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from prx_core.shards.mds.merged import assemble_merged, leave_merged, member_keys
from prx_core.shards.mds.publish import publish_member, publish_stream, unpublish_streams
from prx_core.shards.mds.read import iter_raw_rows, local_copy
from prx_core.shards.mds.retention import read_superseded, referenced_chunks, write_superseded
from prx_core.shards.mds.streams import (
    INDEX,
    MDS_COLUMNS,
    StreamKey,
    chunk_complete,
    list_streams,
    read_chunk_record,
    read_stream_index,
    stream_key_of,
    stream_uri,
    write_chunk,
)
from prx_core.shards.skiplists.files import IDS_SUFFIX, SUFFIX, decode, stream_folder, stream_key, write_stream_lists
from prx_core.shards.skiplists.records import check_record, read_record
from prx_core.store import lance_io, schemas
from prx_core.store.partitions import commit_partition, source_predicate
from prx_core.store.storage import Storage, filesystem_for, join_uri
from prx_core.upkeep.indexing import index_table

REWRITE_FORMAT = "rewrite-1"  # bump when what a rewritten chunk's bytes depend on changes
Lists = dict[str, tuple[np.ndarray, pa.Array]]  # reason -> (sorted positions, aligned sample ids)


@dataclass
class StreamRewrite:
    """What republishing one stream did."""

    stream: str  # <source>/<tier>/<w>x<h>
    before: int
    after: int
    chunks_rewritten: int
    chunks_kept: int
    superseded: list[str] = field(default_factory=list)  # chunk folders the new index no longer references
    unpublished: bool = False

    @property
    def dropped(self) -> int:
        return self.before - self.after


def stream_chunks(storage: Storage, uri: str) -> tuple[bytes, list[tuple[str, int]]]:
    """The stream's index.json bytes (a merged member's member.json) and its chunk folders in order
    with their sample counts."""
    data = read_stream_index(storage.filesystem(), uri)
    chunks: dict[str, int] = {}
    for shard in json.loads(data)["shards"]:
        name = shard["raw_data"]["basename"].split("/", 1)[0]
        chunks[name] = chunks.get(name, 0) + int(shard["samples"])
    return data, list(chunks.items())


def read_stream_lists(storage: Storage, source: str, key: StreamKey) -> Lists:
    """Every skip-list of one stream, with its sample ids (bounded by the stream's skipped count)."""
    fs = storage.filesystem()
    folder = stream_folder(storage.root, source, *key)
    fs.invalidate_cache()
    lists: Lists = {}
    for path in sorted(fs.glob(join_uri(folder, f"*{SUFFIX}"))) if fs.exists(folder) else []:
        uri = join_uri(folder, path.rstrip("/").rsplit("/", 1)[-1])
        header, indices = decode(fs.cat_file(uri), uri)
        with fs.open(uri.removesuffix(SUFFIX) + IDS_SUFFIX, "rb") as handle:
            ids = pq.read_table(handle, pre_buffer=False)["sample_id"]
        lists[header["reason"]] = (np.asarray(indices, np.int64), ids.combine_chunks())
    return lists


def current_record(storage: Storage, source: str, key: StreamKey, uri: str) -> dict:
    """The stream's completion record, refused (UnfilteredStream, naming the fix) unless it was
    written for the stream's current index: a rewrite must never bless stale lists."""
    data, _ = stream_chunks(storage, uri)
    count = sum(int(s["samples"]) for s in json.loads(data)["shards"])
    record = read_record(storage.filesystem(), stream_folder(storage.root, source, *key))
    reasons = list(read_stream_lists(storage, source, key))
    check_record(record, stream_key(source, *key), count, hashlib.sha256(data).hexdigest(), reasons)
    return record or {}  # check_record refused a missing one


def remap_lists(lists: Lists, drop: np.ndarray) -> Lists:
    """The lists after the positions `drop` (sorted, unique) left the stream: those positions go,
    every other one moves down by the dropped positions before it."""
    out: Lists = {}
    for reason, (indices, ids) in lists.items():
        keep = ~np.isin(indices, drop)
        kept = indices[keep]
        moved = kept - np.searchsorted(drop, kept)
        if len(moved):
            out[reason] = (moved.astype(np.int64), ids.filter(pa.array(keep)))
    return out


def rewritten_name(old: str, dropped_ids: list[str]) -> str:
    """A chunk name derived from the chunk it replaces and what it drops: a rerun finds it
    complete and reuses it, and no other content ever gets it."""
    digest = hashlib.sha256(json.dumps([REWRITE_FORMAT, old, sorted(dropped_ids)]).encode())
    return "c-" + digest.hexdigest()[:24]


def _kept_rows(storage: Storage, folder: str, stored: pa.Table, drop_local: set[int],
               columns: dict[str, str]) -> Iterator[dict]:
    """The chunk's stored rows in order (`stored`: its record's rows with no reason), dropped
    positions left out, images and text latents verbatim (the writer stores bytes as given)."""
    from streaming.base.format.mds.encodings import mds_decode

    stored = stored.select(["content_id", "source_key", "caption_key"]).to_pylist()
    with local_copy(folder, storage.storage_options) as local:
        with open(os.path.join(local, INDEX)) as handle:
            index = json.load(handle)
        for position, (_, raw) in enumerate(iter_raw_rows(local, index)):
            if position in drop_local:
                continue
            row = {k: mds_decode(columns[k], v) if k in MDS_COLUMNS else v for k, v in raw.items()
                   if columns[k] != "jpeg"}
            row["jpeg"] = raw["image"]
            row["content_id"], row["source_key"] = stored[position]["content_id"], stored[position]["source_key"]
            row["caption_key"] = stored[position]["caption_key"]  # what skip_lists looks the labels up by
            yield row


def chunk_columns(storage: Storage, folder: str) -> dict[str, str]:
    """The chunk's MDS columns (name -> encoding), text latents included, from its index.json."""
    with filesystem_for(folder, storage.storage_options).open(join_uri(folder, INDEX)) as handle:
        shards = json.load(handle)["shards"]
    return dict(zip(shards[0]["column_names"], shards[0]["column_encodings"])) if shards else dict(MDS_COLUMNS)


def rewrite_chunk(storage: Storage, uri: str, name: str, drop_local: set[int]) -> tuple[str | None, int]:
    """Write the chunk without its `drop_local` positions as a new folder; (its name, or None when
    nothing is left, and the rows it keeps)."""
    folder = join_uri(uri, name)
    record = read_chunk_record(folder, storage.storage_options)
    stored = record.filter(pc.field("reason").is_null())
    ids = stored["sample_id"].to_pylist()
    kept = stored.num_rows - len(drop_local)
    if kept <= 0:
        return None, 0
    new = rewritten_name(name, [ids[i] for i in sorted(drop_local)])
    target = join_uri(uri, new)
    if not chunk_complete(target, storage.storage_options):
        refused = record.filter(pc.field("reason").is_valid()).to_pylist()
        columns = chunk_columns(storage, folder)
        write_chunk(_kept_rows(storage, folder, stored, drop_local, columns), target, storage.storage_options, refused,
                    columns=columns)
    return new, kept


def rewrite_stream(storage: Storage, source: str, key: StreamKey, drop: np.ndarray) -> StreamRewrite:
    """Republish the stream without the positions `drop` (its skip-lists remapped, a fresh record,
    its `mds_index` rows replaced). The stream's record must hold for its current index."""
    uri = stream_uri(storage.root, source, *key)
    drop = np.unique(np.asarray(drop, np.int64))
    record = current_record(storage, source, key, uri)
    lists = read_stream_lists(storage, source, key)
    _, chunks = stream_chunks(storage, uri)
    if not len(drop):  # nothing to drop: the stream and its lists stay as they are
        size = sum(count for _, count in chunks)
        return StreamRewrite(stream_key(source, *key), size, size, 0, len(chunks))
    names, offset, replaced = [], 0, []
    for name, count in chunks:
        local = drop[(drop >= offset) & (drop < offset + count)] - offset
        if len(local):
            new, _ = rewrite_chunk(storage, uri, name, set(local.tolist()))
            replaced.append(name)
            if new is not None:
                names.append(new)
        else:
            names.append(name)
        offset += count
    label = stream_key(source, *key)
    fs = storage.filesystem()
    folder = stream_folder(storage.root, source, *key)
    member = not fs.exists(join_uri(uri, INDEX))  # merged into `_merged` (training.small_streams: merge)
    if not names:  # every sample dropped: the stream goes, and its lists with it
        others = {k for k in _published_keys(storage, source) if k != key}
        unpublish_streams(storage.root, source, others, storage.storage_options)
        if member:
            leave_merged(storage.root, source, set(member_keys(storage.root, source, storage.storage_options)) - {key},
                         storage.storage_options)
            assemble_merged(storage.root, key, storage.storage_options)
        if fs.exists(folder):
            fs.rm(folder, recursive=True)
        _replace_index_rows(storage, source, key, uri, [])
        return StreamRewrite(label, offset, 0, len(replaced), len(chunks) - len(replaced), [n for n, _ in chunks], True)
    if member:  # the merged stream is reassembled by the caller's publish_source_manifest
        size = publish_member(storage.root, source, key, names, storage.storage_options)
    else:
        size = publish_stream(uri, names, storage.storage_options)
    digest = hashlib.sha256(read_stream_index(fs, uri)).hexdigest()
    header = {"source": source, "tier": key[0], "width": key[1], "height": key[2], "stream": label,
              "stream_size": size, "policy_version": record["policy_version"], "index_digest": digest}
    _replace_index_rows(storage, source, key, uri, names)
    write_stream_lists(fs, folder, header, remap_lists(lists, drop), record.get("reasons_applied") or [])  # last
    return StreamRewrite(label, offset, size, len(replaced), len(chunks) - len(replaced), replaced)


def _published_keys(storage: Storage, source: str) -> set[StreamKey]:
    return {stream_key_of(uri) for uri in list_streams(storage.root, source, storage.storage_options)}


def stream_predicate(source: str, key: StreamKey) -> str:
    return f"{source_predicate(source)} AND tier = {int(key[0])} AND bucket = '{int(key[1])}x{int(key[2])}'"


def _replace_index_rows(storage: Storage, source: str, key: StreamKey, uri: str, names: list[str]) -> int | None:
    """Replace the stream's `mds_index` rows by its new chunks' records, in one commit."""
    table, options = storage.lance_uri("mds_index"), storage.lance_storage_options()
    ds = lance_io.open_table(table, options)
    if ds is None:
        return None
    predicate = stream_predicate(source, key)
    old = ds.to_table(columns=["captioner_version"], filter=predicate, limit=1)["captioner_version"].to_pylist()
    captioner = old[0] if old else ""

    def batches() -> Iterator[pa.RecordBatch]:
        offset = 0
        for name in names:
            stored = read_chunk_record(join_uri(uri, name), storage.storage_options).filter(pc.field("reason").is_null())
            n = stored.num_rows
            yield from pa.table({
                "sample_id": stored["sample_id"], "source": pa.array([source] * n, pa.string()),
                "content_id": stored["content_id"], "tier": pa.array([key[0]] * n, pa.int32()),
                "bucket": pa.array([f"{key[1]}x{key[2]}"] * n, pa.string()),
                "index": pa.array(np.arange(offset, offset + n), pa.int64()), "image_sha256": stored["image_sha256"],
                "captioner_version": pa.array([captioner] * n, pa.string())}, schema=schemas.MDS_INDEX).to_batches()
            offset += n

    fragments = lance_io.write_fragments(table, batches(), schemas.MDS_INDEX, options) if names else []
    return commit_partition(storage, "mds_index", predicate, fragments, index_table)


def remove_superseded_now(storage: Storage, uri: str, names: list[str]) -> list[str]:
    """Delete these superseded chunk folders of a stream at once, not a retention later (a
    takedown: a trainer still holding the old index.json loses them); names the published index
    references are never touched. Returns the folders removed."""
    fs = storage.filesystem()
    fs.invalidate_cache()
    referenced = referenced_chunks(fs, uri)
    removed = []
    for name in names:
        folder = join_uri(uri, name)
        if name not in referenced and fs.exists(folder):
            fs.rm(folder, recursive=True)
            removed.append(folder)
    record = read_superseded(fs, uri)
    left = {n: t for n, t in record.items() if n not in set(names) or n in referenced}
    if left != record and fs.exists(uri):
        write_superseded(fs, uri, left)
    fs.invalidate_cache()
    return removed
