"""Publishing corpus manifests (`prx_core.shards.manifest`): what the loader used to find out per
rank at start-up, found out once per source when its streams or skip-lists change.

`publish_source_manifest` lists one source's streams, checks each against its skip-list record
(as the loader did: a stream without a record for its current index.json is *refused*, with the
reason, not left out silently), unions its skip-lists, rewrites the source's part of every tier
it has, then assembles each of those tiers' manifests. Parts are per source, so two sources
publishing at once never write the same part; the tier's manifest is the one thing they share, and
the assembler re-lists the parts after moving `current.json`: a part that changed meanwhile means
assembling again, so the last pointer written always includes every part written before it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import fsspec

from prx_core.shards.manifest import (
    CURRENT,
    FOLDER,
    PARTS,
    SUFFIX,
    StreamPlan,
    current_name,
    encode,
    encode_head,
    entry,
    part_uri,
    read_framed_header,
    read_manifest_header,
    shards_digest,
    tier_folder,
)
from prx_core.shards.mds.merged import assemble_source_members
from prx_core.shards.mds.retention import (
    RETENTION_SECONDS,
    note_superseded,
    read_superseded,
    split_expired,
    write_superseded,
)
from prx_core.shards.mds.streams import INDEX, StreamKey, list_streams
from prx_core.shards.node_cache import default_cache_dir, skip_union
from prx_core.shards.skiplists.files import SUFFIX as SKIP_SUFFIX
from prx_core.shards.skiplists.files import list_skip_files, stream_folder, stream_key
from prx_core.shards.skiplists.records import UnfilteredStream, check_record, read_record
from prx_core.store import fencing
from prx_core.store.names import MERGED, validate_source_name
from prx_core.store.storage import filesystem_for, join_uri, normalize_root, put_atomic

log = logging.getLogger(__name__)

ASSEMBLE_ATTEMPTS = 5  # re-assemblies when other sources keep publishing parts meanwhile
COPY_BYTES = 8 << 20  # positions copied from a part to the manifest per read


def list_plans(root: str, tier: int | None, sources: Sequence[str] | None, storage_options: dict | None = None,
               cache_dir: str | None = None, allow_unfiltered: bool = False) -> tuple[list[StreamPlan], dict[str, str]]:
    """The published streams of `sources` (default all) in `tier` (default all), read from the
    folders: (plans, refused name -> why). A stream without a skip-list record for its current
    index.json is refused, or planned with the lists it has and a warning under `allow_unfiltered`;
    lists computed for another version of their stream are always refused."""
    root = normalize_root(root)
    fs = filesystem_for(root, storage_options)
    cache = cache_dir or default_cache_dir(root)
    plans, refused = [], {}
    for source in sources if sources is not None else [None]:
        skips: dict[str, list[str]] = {}
        for uri in list_skip_files(root, source, tier, storage_options):
            src, t, bucket = uri.rsplit("/", 4)[-4:-1]
            skips.setdefault(f"{src}/{t}/{bucket}", []).append(uri)
        for uri in list_streams(root, source, storage_options):  # sorted by (source, tier, w, h)
            src, t, bucket = uri.rstrip("/").rsplit("/", 3)[-3:]
            if tier is not None and int(t) != int(tier):
                continue
            w, h = (int(x) for x in bucket.split("x"))
            name = stream_key(src, int(t), w, h)
            try:
                plans.append(_plan(fs, root, uri, (src, int(t), w, h), skips.get(name, []), cache, allow_unfiltered))
            except UnfilteredStream as exc:
                refused[name] = str(exc)
            except ValueError as exc:  # lists for another version of the stream
                if "another version" not in str(exc):
                    raise
                refused[name] = str(exc)
    return plans, refused


def _plan(fs: fsspec.AbstractFileSystem, root: str, uri: str, key: tuple[str, int, int, int], lists: list[str],
          cache: str, allow_unfiltered: bool) -> StreamPlan:
    index = fs.cat_file(join_uri(uri, INDEX))
    parsed = json.loads(index)
    count = sum(int(s["samples"]) for s in parsed["shards"])
    name, digest = stream_key(*key), hashlib.sha256(index).hexdigest()
    reasons = [u.rsplit("/", 1)[-1].removesuffix(SKIP_SUFFIX) for u in lists]
    record = read_record(fs, stream_folder(root, *key))
    try:
        check_record(record, name, count, digest, reasons)
    except UnfilteredStream as exc:
        if not allow_unfiltered:
            raise
        warnings.warn(f"allow_unfiltered: training on {name} without its filter: {exc}", stacklevel=4)
    skipped = skip_union(fs, lists, name, count, digest, cache)
    counts = {r: int(n) for r, n in ((record or {}).get("counts") or {}).items() if n}
    return StreamPlan(*key, uri, count, skipped, digest, shards_digest(parsed), counts)


def publish_source_manifest(root: str, source: str, storage_options: dict | None = None,
                            now: float | None = None, merged: Iterable[StreamKey] = ()) -> dict[int, str]:
    """Rewrite `source`'s part of every tier it has (or had), then assemble those tiers'
    manifests: tier -> the manifest now current. Call after the source's streams or lists change.
    The merged streams it is a member of (and `merged`: those it just left) are reassembled first,
    and the `_merged` part with them."""
    root = normalize_root(root)
    validate_source_name(source)
    fs = filesystem_for(root, storage_options)
    tiers = write_parts(fs, root, source, storage_options)
    if keys := assemble_source_members(root, source, storage_options, also=merged):
        tiers |= write_parts(fs, root, MERGED, storage_options) | {key[0] for key in keys}
    return {tier: assemble_tier(root, tier, storage_options, now) for tier in sorted(tiers)}


def write_parts(fs: fsspec.AbstractFileSystem, root: str, source: str, storage_options: dict | None) -> set[int]:
    """Rewrite `source`'s part of every tier it has or had: the tiers to assemble."""
    plans, refused = list_plans(root, None, [source], storage_options)
    tiers = {p.tier for p in plans} | {int(name.split("/")[1]) for name in refused}
    fs.invalidate_cache()
    had = {int(p.rstrip("/").rsplit("/", 3)[-3]) for p in fs.glob(join_uri(root, FOLDER, "*", PARTS, f"{source}{SUFFIX}"))}
    for tier in sorted(tiers | had):
        uri = part_uri(root, tier, source)
        mine = [p for p in plans if p.tier == tier]
        why = {n: r for n, r in refused.items() if int(n.split("/")[1]) == tier}
        if mine or why:
            put_atomic(fs, uri, encode(tier, [entry(p, root) for p in mine], [p.skipped for p in mine], why,
                                       {"source": source}))
        else:
            fs.rm_file(uri)
    return tiers | had


def _fingerprints(fs: fsspec.AbstractFileSystem, folder: str) -> dict[str, tuple]:
    """Part name -> what changes when it is rewritten (an atomic replace gets a new inode or ETag)."""
    fs.invalidate_cache()
    if not fs.exists(folder):
        return {}
    return {info["name"].rstrip("/").rsplit("/", 1)[-1]: (info.get("size"), info.get("ETag") or info.get("ino"),
                                                         info.get("mtime") or info.get("LastModified"))
            for info in fs.ls(folder, detail=True) if info["name"].endswith(SUFFIX)}


def assemble_tier(root: str, tier: int, storage_options: dict | None = None, now: float | None = None) -> str:
    """Concatenate the tier's parts into its manifest and make it current; returns its name."""
    root = normalize_root(root)
    fs = filesystem_for(root, storage_options)
    folder = tier_folder(root, tier)
    for _ in range(ASSEMBLE_ATTEMPTS):
        seen = _fingerprints(fs, join_uri(folder, PARTS))
        pointer = _write_manifest(fs, folder, tier, [join_uri(folder, PARTS, part) for part in sorted(seen)])
        name, previous = pointer["manifest"], _current(root, tier, storage_options)
        if previous != name:
            note_superseded(fs, folder, [previous] if previous else [], [name], now)
            put_atomic(fs, join_uri(folder, CURRENT), json.dumps(pointer, sort_keys=True).encode())
        if _fingerprints(fs, join_uri(folder, PARTS)) == seen:
            break
    else:
        log.warning("tier %s: parts kept changing over %d assemblies; the next publish assembles again",
                    tier, ASSEMBLE_ATTEMPTS)
    prune_manifests(fs, folder, name, now=now)
    return name


def _write_manifest(fs: fsspec.AbstractFileSystem, folder: str, tier: int, parts: list[str]) -> dict[str, Any]:
    """The parts' headers merged, then their positions streamed after it in COPY_BYTES pieces (a
    1B-sample tier's 400 MB never held at once), into a temporary object renamed to its digest;
    returns what `current.json` says of it."""
    heads = [read_framed_header(fs, uri) for uri in parts]
    entries = [{k: v for k, v in e.items() if k != "offset"} for header, _ in heads for e in header["streams"]]
    refused = {n: why for header, _ in heads for n, why in header["refused"].items()}
    sources = {header["source"]: len(header["streams"]) for header, _ in heads}
    head = encode_head(tier, entries, refused, {"sources": sources})
    digest, tmp = hashlib.sha256(head), join_uri(folder, f".assembling-{uuid.uuid4().hex}{SUFFIX}")
    fencing.ensure_held()
    with fs.open(tmp, "wb") as out:
        out.write(head)
        for uri, (header, offset) in zip(parts, heads):
            with fs.open(uri, "rb") as part:
                part.seek(offset)
                left = 8 * int(header["count"])
                while left:
                    piece = part.read(min(COPY_BYTES, left))
                    if not piece:
                        raise ValueError(f"{uri}: truncated corpus manifest part: republish its source")
                    digest.update(piece)
                    out.write(piece)
                    left -= len(piece)
    name = f"m-{digest.hexdigest()[:20]}{SUFFIX}"
    if fs.exists(join_uri(folder, name)):
        fs.rm_file(tmp)
    else:
        fs.mv(tmp, join_uri(folder, name))
    return {"manifest": name, "streams": len(entries), "samples": sum(e["count"] for e in entries),
            "skipped": sum(int(e["skips"]) for e in entries), "refused": len(refused)}


def _current(root: str, tier: int, storage_options: dict | None) -> str | None:
    try:
        return current_name(root, tier, storage_options)
    except UnfilteredStream:
        return None


def prune_manifests(fs: fsspec.AbstractFileSystem, folder: str, current: str,
                    retention_seconds: float = RETENTION_SECONDS, now: float | None = None) -> list[str]:
    """Remove the tier's manifests superseded for a whole retention (a pinned trainer's stays that
    long); one never recorded (a crash before its pointer, an assembler's temporary) counts from now."""
    now = time.time() if now is None else now
    record = read_superseded(fs, folder)
    fs.invalidate_cache()
    names = [path.rstrip("/").rsplit("/", 1)[-1] for path in fs.ls(folder, detail=False)]
    old = [n for n in names if n.startswith(("m-", ".assembling-")) and n.endswith(SUFFIX) and n != current]
    removed, kept = split_expired(old, record, now, retention_seconds)
    for name in removed:
        fs.rm_file(join_uri(folder, name))
    if kept != record:
        write_superseded(fs, folder, kept)
    return removed


def source_in_manifests(root: str, source: str, digests: dict[str, str], storage_options: dict | None = None) -> bool:
    """Whether the current manifests hold exactly `source`'s streams (name -> index digest), none
    refused: what a `skip_lists` rerun with nothing to change must still find."""
    root = normalize_root(root)
    found: dict[str, str] = {}
    for tier in sorted({int(name.split("/")[1]) for name in digests}):
        name = _current(root, tier, storage_options)
        if name is None:
            return False
        header = read_manifest_header(root, tier, name, storage_options)
        if any(n.split("/")[0] == source for n in header["refused"]):
            return False
        found.update({stream_key(source, tier, s["width"], s["height"]): s["index_digest"]
                      for s in header["streams"] if s["source"] == source})
    return found == digests


def prune_tier_manifests(root: str, retention_seconds: float = RETENTION_SECONDS, storage_options: dict | None = None,
                         now: float | None = None) -> list[str]:
    """Every tier's manifests superseded for the retention (what `compact_corpus` runs, so they go
    also when no source publishes): the URIs removed. The current one always stays."""
    root = normalize_root(root)
    fs = filesystem_for(root, storage_options)
    fs.invalidate_cache()
    removed = []
    base = join_uri(root, FOLDER)
    for path in fs.ls(base, detail=False) if fs.exists(base) else []:
        tier = path.rstrip("/").rsplit("/", 1)[-1]
        current = _current(root, int(tier), storage_options) if tier.isdigit() else None
        if current is not None:
            folder = tier_folder(root, int(tier))
            removed += [join_uri(folder, n) for n in prune_manifests(fs, folder, current, retention_seconds, now)]
    return removed


def manifest_sources(root: str, storage_options: dict | None = None) -> list[str]:
    """Every source with a published stream or a manifest part: what `publish_manifests` covers."""
    root = normalize_root(root)
    fs = filesystem_for(root, storage_options)
    fs.invalidate_cache()
    return sorted({uri.rstrip("/").rsplit("/", 3)[-3] for uri in list_streams(root, None, storage_options)}
                  | {p.rstrip("/").rsplit("/", 1)[-1].removesuffix(SUFFIX)
                     for p in fs.glob(join_uri(root, FOLDER, "*", PARTS, f"*{SUFFIX}"))})


def publish_manifests(root: str, storage_options: dict | None = None) -> dict[str, dict[int, str]]:
    """Every source's parts and every tier's manifest, from the folders (a corpus written before
    manifests, or a repair): source -> tier -> manifest name."""
    return {source: publish_source_manifest(root, source, storage_options)
            for source in manifest_sources(root, storage_options)}
