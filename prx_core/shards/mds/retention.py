"""MDS retention aged from supersession: a chunk goes a retention after it stopped being referenced.

A trainer holds the `index.json` it started with and fetches shards for days; a chunk the new
index dropped must outlive that. Write times are the wrong clock (a stream republished 8 days
after its last publish lost its old chunks at the next prune, under a trainer still reading
them), so each stream keeps `superseded.json` next to its index: chunk folder (or loose file)
name -> when it stopped being referenced. `publish_stream` and `unpublish_streams` record what
they drop, in the same atomic way as the index, before the index changes; `prune_streams`
records anything else unreferenced (a crashed writer's chunk, a pre-chunk shard, a record lost
to a crash) as of the first prune that sees it, and removes a name only once it has been
unreferenced for the whole retention. A name referenced again (content-named chunks come back
when content does) leaves the record.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import fsspec

from prx_core.shards.mds.streams import BUCKET_FOLDER, INDEX, MEMBER_INDEX
from prx_core.store.names import validate_source_name
from prx_core.store.storage import filesystem_for, join_uri, normalize_root, put_atomic

log = logging.getLogger(__name__)

RETENTION_SECONDS = 7 * 24 * 3600  # superseded chunks outlive the index that dropped them by this much
SUPERSEDED = "superseded.json"
RECORD_VERSION = 1
MEMBERS = ".members"  # a merged stream's member registrations (prx_core.shards.mds.merged)


def index_chunks(index: dict) -> set[str]:
    """The top-level names (chunk folders) an index.json's shards live in."""
    return {shard["raw_data"]["basename"].split("/", 1)[0] for shard in index["shards"]}


def referenced_chunks(fs: fsspec.AbstractFileSystem, stream: str,
                      indexes: tuple[str, ...] = (INDEX, MEMBER_INDEX)) -> set[str]:
    """The chunk folders the stream's published index.json references, or its member.json when it
    is merged into `_merged` (both, briefly, while it becomes a member)."""
    names: set[str] = set()
    for path in (join_uri(stream, name) for name in indexes):
        if fs.exists(path):
            names |= index_chunks(json.loads(fs.cat_file(path)))
    return names


def named_by_index(storage_options: dict | None = None) -> Callable[[str], bool]:
    """`named(uri)`: whether the chunk folder at `uri` is named by its stream's published index.json
    (or member.json): what discarding an abandoned attempt must keep, since a reader may hold that
    index; it goes by `prune_streams` a retention after an index without it is published. Each
    stream's index is read once, when first asked (the partition lock keeps it as it is)."""
    names: dict[str, set[str]] = {}

    def named(uri: str) -> bool:
        stream, _, name = uri.rstrip("/").rpartition("/")
        if stream not in names:
            fs = filesystem_for(stream, storage_options)
            fs.invalidate_cache()
            names[stream] = referenced_chunks(fs, stream)
        return name in names[stream]

    return named


def read_superseded(fs: fsspec.AbstractFileSystem, stream: str) -> dict[str, float]:
    """name -> epoch seconds it stopped being referenced. A damaged record is read as empty (its
    names are recorded again as of now: they only stay longer) with a warning."""
    path = join_uri(stream, SUPERSEDED)
    if not fs.exists(path):
        return {}
    try:
        record = json.loads(fs.cat_file(path))
        return {str(name): float(since) for name, since in record["superseded"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("%s: unreadable supersession record, its names count from now: %s", path, exc)
        return {}


def write_superseded(fs: fsspec.AbstractFileSystem, stream: str, record: dict[str, float]) -> None:
    """Write the record atomically (like index.json); an empty record is removed."""
    path = join_uri(stream, SUPERSEDED)
    if record:
        payload = {"version": RECORD_VERSION, "superseded": dict(sorted(record.items()))}
        put_atomic(fs, path, json.dumps(payload, sort_keys=True).encode())
    elif fs.exists(path):
        fs.rm_file(path)


def note_superseded(fs: fsspec.AbstractFileSystem, stream: str, before: Iterable[str], after: Iterable[str],
                    now: float | None = None) -> None:
    """Before a stream's index changes from referencing `before` to `after`: record the names it
    drops as superseded now (an earlier time already recorded stays) and forget the names it
    references again. Nothing is written when nothing changes."""
    now = time.time() if now is None else now
    record = read_superseded(fs, stream)
    updated = {name: since for name, since in record.items() if name not in set(after)}
    for name in set(before) - set(after):
        updated.setdefault(name, now)
    if updated != record:
        write_superseded(fs, stream, updated)


def split_expired(names: Iterable[str], record: dict[str, float], now: float,
                  retention_seconds: float) -> tuple[list[str], dict[str, float]]:
    """Unreferenced `names` as (those unreferenced for the whole retention, name -> since for the
    rest); a name the record lacks counts from `now` (a crash's leftover is kept a retention too)."""
    expired, kept = [], {}
    for name in names:
        since = record.get(name, now)
        if now - since >= retention_seconds:
            expired.append(name)
        else:
            kept[name] = since
    return expired, kept


@dataclass
class PruneReport:
    streams: int = 0
    removed: list[str] = field(default_factory=list)  # chunk folders and loose files, as URIs
    kept_recent: int = 0  # unreferenced, but for less than the retention


def prune_streams(root: str, retention_seconds: float = RETENTION_SECONDS, storage_options: dict | None = None,
                  source: str | None = None, now: float | None = None) -> PruneReport:
    """Delete what no published index.json references (superseded chunks, crashed writers'
    leftovers, pre-chunk shards) once it has been unreferenced for `retention_seconds`, by the
    stream's supersession record. Never touches what an index references (read again right before
    each removal), so only readers older than the retention can lose their shards."""
    root = normalize_root(root)
    fs = filesystem_for(root, storage_options)
    now = time.time() if now is None else now
    report = PruneReport()
    for stream in _stream_folders(fs, root, source):
        report.streams += 1
        referenced = referenced_chunks(fs, stream)
        record = read_superseded(fs, stream)
        unreferenced = [name for name in _entries(fs, stream) if name not in referenced]
        expired, kept = split_expired(unreferenced, record, now, retention_seconds)
        report.kept_recent += len(kept)
        if expired:
            referenced = referenced_chunks(fs, stream)  # a publish may have taken one back meanwhile
        for name in expired:
            if name in referenced:
                continue
            fs.rm(join_uri(stream, name), recursive=True)
            report.removed.append(join_uri(stream, name))
        if kept != record:
            write_superseded(fs, stream, kept)
    fs.invalidate_cache()
    return report


def _entries(fs: fsspec.AbstractFileSystem, stream: str) -> list[str]:
    """The stream folder's top-level names other than its index and its record."""
    fs.invalidate_cache()
    names = {path.rstrip("/").rsplit("/", 1)[-1] for path in fs.ls(stream, detail=False)}
    return sorted(names - {INDEX, MEMBER_INDEX, SUPERSEDED, MEMBERS})


def _stream_folders(fs: fsspec.AbstractFileSystem, root: str, source: str | None) -> list[str]:
    """`mds/<source>/<tier>/<w>x<h>` folders, found level by level (a delimited listing each): a
    recursive listing of `mds/` would return every shard of the corpus, millions at 1B images."""
    base = join_uri(root, "mds")
    named = [validate_source_name(source)] if source is not None else None  # refused before any I/O
    fs.invalidate_cache()
    if not fs.exists(base):
        return []
    sources = named if named is not None else [
        name for name in _folder_names(fs, base) if not name.startswith(".")]
    found = []
    for name in sources:
        for tier in (t for t in _folder_names(fs, join_uri(base, name)) if t.isdigit()):
            found += [join_uri(base, name, tier, bucket) for bucket in _folder_names(fs, join_uri(base, name, tier))
                      if BUCKET_FOLDER.fullmatch(bucket)]
    return sorted(found)


def _folder_names(fs: fsspec.AbstractFileSystem, folder: str) -> list[str]:
    """The names of the folders directly under `folder` (none where it does not exist)."""
    try:
        listed = fs.ls(folder, detail=True)
    except FileNotFoundError:
        return []
    return [info["name"].rstrip("/").rsplit("/", 1)[-1] for info in listed if info.get("type") == "directory"]
