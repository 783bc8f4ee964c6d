"""Merged small streams (`training.small_streams: merge`): the streams too small to fill one global
batch x the trainer's canonical nodes, joined across sources into one stream per (tier, bucket).

PRX's trainer lists `<root>/mds/<source>/<tier>` and takes whole global batches from one stream,
so a stream below that size must not be there. Under `merge` such a stream of a source becomes a
*member*: its chunks stay in its folder with its index written as `member.json` (not `index.json`:
no trainer lists it; `skip_lists`, `mds_index` and the explorer treat it as a stream as before,
positions within the member), its chunk folders are copied (server-side on S3) into the merged
stream `<root>/mds/_merged/<tier>/<w>x<h>/` as `<source>.<chunk>`, and a copy of its `member.json`
is registered there under `.members/<source>.json`. `assemble_merged` then writes the merged
stream's index.json (members in source order) and its skip-lists (each member's positions offset
by the samples before it), bound to that index. `_merged` is a pseudo-source: a trainer lists
`<root>/mds/_merged/<tier>` like any source, and the corpus manifest lists its streams.

A copied chunk is never rewritten (chunk names are content-derived), the index is replaced in one
atomic step and the chunks it stops referencing are recorded as superseded, so a trainer holding
the old index keeps reading until `prune_streams` removes them a retention later.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from prx_core.shards.mds.retention import MEMBERS, index_chunks, note_superseded, referenced_chunks
from prx_core.shards.mds.streams import (
    BUCKET_FOLDER,
    INDEX,
    MEMBER_INDEX,
    StreamKey,
    chunk_complete,
    list_files,
    merge_indexes,
    stream_uri,
)
from prx_core.shards.skiplists.files import IDS_SUFFIX, SUFFIX, decode, stream_folder, stream_key, write_stream_lists
from prx_core.shards.skiplists.records import UnfilteredStream, check_record, read_record, record_uri, write_record
from prx_core.store.names import MERGED, validate_source_name
from prx_core.store.storage import filesystem_for, join_uri, normalize_root, put_atomic

ASSEMBLE_ATTEMPTS = 5  # re-assemblies while other sources keep changing their members


def join_merged(root: str, source: str, key: StreamKey, chunks: Sequence[str],
                storage_options: dict | None = None) -> None:
    """After `publish.publish_member` wrote the member.json of `source`'s stream `key`: its own
    index.json (if it was published alone) removed, its chunks copied into the merged stream and
    the member registered there."""
    root = normalize_root(root)
    fs = filesystem_for(root, storage_options)
    uri = stream_uri(root, source, *key)
    if fs.exists(join_uri(uri, INDEX)):
        fs.rm_file(join_uri(uri, INDEX))
    merged = stream_uri(root, MERGED, *key)
    for name in chunks:
        copy_chunk(fs, join_uri(uri, name), join_uri(merged, f"{source}.{name}"))
    put_atomic(fs, join_uri(merged, MEMBERS, f"{source}.json"), fs.cat_file(join_uri(uri, MEMBER_INDEX)))
    fs.invalidate_cache()


def copy_chunk(fs: fsspec.AbstractFileSystem, src: str, dst: str) -> None:
    """Copy a complete chunk folder, its index.json last (what makes a chunk complete), unless the
    destination is complete already: a content-named chunk is the same bytes wherever it is."""
    if chunk_complete(dst):
        return
    files = sorted(list_files(fs, src), key=lambda name: name == INDEX)
    fs.makedirs(dst, exist_ok=True)  # a local folder; nothing on S3
    for name in files:
        fs.copy(join_uri(src, name), join_uri(dst, name))  # server-side on S3


def leave_merged(root: str, source: str, keep: set[StreamKey], storage_options: dict | None = None) -> list[StreamKey]:
    """Every member stream of `source` not in `keep` stops being one (its member.json and its
    registration go; its chunks are recorded as superseded): the keys whose merged streams changed."""
    root = normalize_root(root)
    fs = filesystem_for(root, storage_options)
    left = []
    for key in sorted(set(member_keys(root, source, storage_options)) - keep):
        uri = stream_uri(root, source, *key)
        path = join_uri(uri, MEMBER_INDEX)
        if fs.exists(path):
            note_superseded(fs, uri, referenced_chunks(fs, uri) - referenced_chunks(fs, uri, (INDEX,)), ())
            fs.rm_file(path)
        entry = join_uri(stream_uri(root, MERGED, *key), MEMBERS, f"{source}.json")
        if fs.exists(entry):
            fs.rm_file(entry)
        left.append(key)
    fs.invalidate_cache()
    return left


def member_keys(root: str, source: str, storage_options: dict | None = None) -> list[StreamKey]:
    """The streams of `source` that are members (a member.json) or registered in a merged stream."""
    root = normalize_root(root)
    fs = filesystem_for(root, storage_options)
    fs.invalidate_cache()
    base = join_uri(root, "mds")
    prefix = fs._strip_protocol(base).rstrip("/") + "/"
    keys = set()
    for path in fs.glob(join_uri(base, validate_source_name(source), "*", "*", MEMBER_INDEX)):
        _, tier, bucket, _ = path[len(prefix):].split("/")
        if tier.isdigit() and (size := BUCKET_FOLDER.fullmatch(bucket)):
            keys.add((int(tier), int(size[1]), int(size[2])))
    keys.update(key for key in merged_keys(root, storage_options)
                if fs.exists(join_uri(stream_uri(root, MERGED, *key), MEMBERS, f"{source}.json")))
    return sorted(keys)


def merged_keys(root: str, storage_options: dict | None = None) -> list[StreamKey]:
    """Every (tier, bucket) with a merged stream folder: two listings per tier, whatever the corpus."""
    root = normalize_root(root)
    fs = filesystem_for(root, storage_options)
    base = join_uri(root, "mds", MERGED)
    if not fs.exists(base):
        return []
    keys = []
    for tier in fs.ls(base, detail=False):
        tier = tier.rstrip("/").rsplit("/", 1)[-1]
        for bucket in fs.ls(join_uri(base, tier), detail=False) if tier.isdigit() else []:
            if size := BUCKET_FOLDER.fullmatch(bucket.rstrip("/").rsplit("/", 1)[-1]):
                keys.append((int(tier), int(size[1]), int(size[2])))
    return sorted(keys)


def read_members(fs: fsspec.AbstractFileSystem, merged: str) -> list[tuple[str, bytes]]:
    """(source, member.json bytes) of the merged stream's registered members, by source."""
    folder = join_uri(merged, MEMBERS)
    fs.invalidate_cache()
    if not fs.exists(folder):
        return []
    names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(folder, detail=False))
    return [(n.removesuffix(".json"), fs.cat_file(join_uri(folder, n))) for n in names if n.endswith(".json")]


def assemble_merged(root: str, key: StreamKey, storage_options: dict | None = None) -> str | None:
    """Publish the merged stream of `key` from its members (or unpublish it when none is left),
    then its skip-lists; returns why its lists are pending (a member's lists are missing or stale:
    the record says so and the loader refuses the stream), None when they are current."""
    root = normalize_root(root)
    fs = filesystem_for(root, storage_options)
    merged = stream_uri(root, MERGED, *key)
    seen = _inputs(fs, root, key, merged)
    for _ in range(ASSEMBLE_ATTEMPTS):  # a member or its lists changed meanwhile: that write may predate ours
        pending = _assemble(fs, root, key, merged, [(source, data) for source, data, _ in seen])
        seen, before = _inputs(fs, root, key, merged), seen
        if seen == before:
            break
    return pending


def _inputs(fs: fsspec.AbstractFileSystem, root: str, key: StreamKey, merged: str) -> list[tuple[str, bytes, bytes]]:
    """What the merged stream is made of: (source, member.json, its skip-list record) per member."""
    out = []
    for source, data in read_members(fs, merged):
        try:
            record = fs.cat_file(record_uri(stream_folder(root, source, *key)))
        except FileNotFoundError:
            record = b""
        out.append((source, data, record))
    return out


def _assemble(fs: fsspec.AbstractFileSystem, root: str, key: StreamKey, merged: str,
              members: list[tuple[str, bytes]]) -> str | None:
    index = merge_indexes([(f"{source}.", json.loads(data)) for source, data in members])
    note_superseded(fs, merged, referenced_chunks(fs, merged), index_chunks(index))
    lists_folder = stream_folder(root, MERGED, *key)
    if not members:
        if fs.exists(join_uri(merged, INDEX)):
            fs.rm_file(join_uri(merged, INDEX))
        if fs.exists(lists_folder):
            fs.rm(lists_folder, recursive=True)
        return None
    data = json.dumps(index, sort_keys=True).encode()
    put_atomic(fs, join_uri(merged, INDEX), data)
    fs.invalidate_cache()
    return write_merged_lists(fs, root, key, members, hashlib.sha256(data).hexdigest())


def write_merged_lists(fs: fsspec.AbstractFileSystem, root: str, key: StreamKey, members: list[tuple[str, bytes]],
                       digest: str) -> str | None:
    """The merged stream's skip-lists from its members' current ones, offset by the samples before
    each; when a member has none current, a record that names it (and no lists)."""
    counts = [_count(data) for _, data in members]
    offset = 0
    lists: dict[str, tuple[list[np.ndarray], list[pa.Array]]] = {}
    applied: set[str] = set()
    policies: set[str] = set()
    pending = None
    for (source, data), size in zip(members, counts):
        folder = stream_folder(root, source, *key)
        name = stream_key(source, *key)
        record = read_record(fs, folder)
        reasons = [r for r, n in ((record or {}).get("counts") or {}).items() if n]
        try:
            check_record(record, name, size, hashlib.sha256(data).hexdigest(), reasons)
        except UnfilteredStream as exc:
            pending = f"merged stream {stream_key(MERGED, *key)} waits for the skip-lists of its member {name}: {exc}"
            break
        policies.add(record["policy_version"])
        applied.update(record.get("reasons_applied") or [])
        for reason in reasons:
            _, indices = decode(fs.cat_file(join_uri(folder, f"{reason}{SUFFIX}")), name)
            with fs.open(join_uri(folder, f"{reason}{IDS_SUFFIX}"), "rb") as handle:
                ids = pq.read_table(handle, pre_buffer=False)["sample_id"]
            parts = lists.setdefault(reason, ([], []))
            parts[0].append(indices + offset)
            parts[1].append(ids)
        offset += size
    if pending is None and len(policies) > 1:
        pending = (f"merged stream {stream_key(MERGED, *key)}: its members' skip-lists were computed under different "
                   f"policies ({', '.join(sorted(policies))}): materialize skip_lists for every source with the same policy")
    header = {"source": MERGED, "tier": key[0], "width": key[1], "height": key[2],
              "stream": stream_key(MERGED, *key), "stream_size": sum(counts), "index_digest": digest,
              "policy_version": policies.pop() if len(policies) == 1 else "pending"}
    folder = stream_folder(root, MERGED, *key)
    if pending is not None:
        for path in fs.ls(folder, detail=False) if fs.exists(folder) else []:
            fs.rm(path, recursive=True)
        write_record(fs, folder, {**header, "index_digest": None}, [], {}, pending=pending)
        return pending
    write_stream_lists(fs, folder, header, {r: (np.concatenate(i), pa.chunked_array(s).combine_chunks())
                                            for r, (i, s) in lists.items()}, sorted(applied))
    return None


def merged_current(root: str, key: StreamKey, storage_options: dict | None = None) -> bool:
    """Whether the merged stream of `key` has lists for its current index (none pending)."""
    root = normalize_root(root)
    fs = filesystem_for(root, storage_options)
    try:
        record = read_record(fs, stream_folder(root, MERGED, *key))
        data = fs.cat_file(join_uri(stream_uri(root, MERGED, *key), INDEX))
    except (FileNotFoundError, UnfilteredStream):
        return False
    return bool(record) and not record.get("pending") and record.get("index_digest") == hashlib.sha256(data).hexdigest()


def merged_sizes(root: str, keys: Iterable[StreamKey], storage_options: dict | None = None) -> dict[str, int]:
    """`_merged/<tier>/<w>x<h>` -> samples, of the merged streams of `keys` (0 when unpublished)."""
    root = normalize_root(root)
    fs = filesystem_for(root, storage_options)
    sizes = {}
    for key in sorted(set(keys)):
        try:
            sizes[stream_key(MERGED, *key)] = _count(fs.cat_file(join_uri(stream_uri(root, MERGED, *key), INDEX)))
        except FileNotFoundError:
            sizes[stream_key(MERGED, *key)] = 0
    return sizes


def _count(member: bytes) -> int:
    return sum(int(s["samples"]) for s in json.loads(member)["shards"])


def assemble_source_members(root: str, source: str, storage_options: dict | None = None,
                            also: Iterable[StreamKey] = ()) -> list[StreamKey]:
    """Reassemble the merged streams `source` is a member of (and `also`: those it just left):
    after its members changed (`mds_shards`) or their lists did (`skip_lists`)."""
    if source == MERGED:
        return []
    keys = sorted(set(member_keys(root, source, storage_options)) | set(also))
    for key in keys:
        assemble_merged(root, key, storage_options)
    return keys


__all__ = ["assemble_merged", "assemble_source_members", "join_merged", "leave_merged", "member_keys", "merged_current",
           "merged_keys", "merged_sizes"]
