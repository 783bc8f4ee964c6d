"""The corpus manifest: per tier, every trainable stream with its size, its index digest and its
skip positions, in one file the training loader reads once per node.

Listing ~17k folders and reading ~3,900 index.json and ~20k skip files per rank does not start
a 1B-sample tier (issue 26); the publishers do that work instead, per source, when something
changes (`prx_core.shards.manifest_publish`). Layout under `<root>/manifests/<tier>/`:

- `parts/<source>.prxm`: one source's streams in the tier, rewritten whenever its streams or
  skip-lists change (by `mds_shards`, `skip_lists`, `prx-corpus opt-out` and stream rewrites).
- `m-<sha256[:20]>.prxm`: the tier's manifest, the parts concatenated, named by its content.
- `current.json`: which manifest is current, replaced atomically after it is written; older
  manifests stay a retention (`superseded.json`) for trainers that pinned them.

A `.prxm` file is framed (`prx_core.shards.framed`): its header lists the streams (`source`,
`width`, `height`, `path` under the root, `count`, `index_digest` = SHA-256 of the index.json the
skips refer to, `shards_digest`, `skipped` per reason, `offset` and `skips` into the array) and the
streams refused (name -> why: no skip-list record, a stale one); the array holds every stream's
sorted skip positions, stream-local, concatenated.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from prx_core.shards.framed import frame_head, map_framed, read_head
from prx_core.shards.node_cache import node_lock
from prx_core.shards.skiplists.files import stream_key
from prx_core.shards.skiplists.records import UnfilteredStream
from prx_core.store.storage import filesystem_for, is_remote, join_uri

MAGIC = b"PRXMANI1"
FORMAT_VERSION = 1
FOLDER = "manifests"
CURRENT = "current.json"
PARTS = "parts"
SUFFIX = ".prxm"


class MissingManifest(UnfilteredStream):
    """The tier has no manifest (or not the one asked for): nothing says what is trainable."""


@dataclass(frozen=True)
class StreamPlan:
    """One published bucket folder, its stored sample count and the union of its skip-lists."""

    source: str
    tier: int
    width: int
    height: int
    uri: str
    count: int
    skipped: np.ndarray  # sorted unique stream-local indices (int64), often a view of a mapped file
    index_digest: str  # SHA-256 of the index.json the count and the skips refer to
    shards_digest: str = ""  # SHA-256 of the shard list (basenames, sizes, samples), in order
    reasons: dict[str, int] = field(default_factory=dict)  # samples skipped per reason

    @property
    def name(self) -> str:
        return stream_key(self.source, self.tier, self.width, self.height)


def tier_folder(root: str, tier: int) -> str:
    return join_uri(root, FOLDER, str(int(tier)))


def part_uri(root: str, tier: int, source: str) -> str:
    return join_uri(tier_folder(root, tier), PARTS, f"{source}{SUFFIX}")


def shards_digest(index: dict) -> str:
    """The stream's shard list: what a reader fetches, independent of the index's formatting."""
    text = "\n".join(f"{s['raw_data']['basename']}\t{s['raw_data']['bytes']}\t{s['samples']}" for s in index["shards"])
    return hashlib.sha256(text.encode()).hexdigest()


def entry(plan: StreamPlan, root: str) -> dict[str, Any]:
    """A stream's header entry, its path relative to `root` (a copied or mirrored root still reads)."""
    prefix = root.rstrip("/") + "/"
    if not plan.uri.startswith(prefix):
        raise ValueError(f"stream {plan.uri} is not under the corpus root {root}")
    return {"source": plan.source, "width": plan.width, "height": plan.height, "path": plan.uri[len(prefix):],
            "count": int(plan.count), "index_digest": plan.index_digest, "shards_digest": plan.shards_digest,
            "skipped": dict(sorted(plan.reasons.items())), "skips": len(plan.skipped)}


def encode(tier: int, entries: list[dict[str, Any]], positions: list[np.ndarray], refused: dict[str, str],
           extra: dict | None = None) -> bytes:
    """A part or a manifest: entries (each with its `skips` positions, aligned) get their offsets."""
    array = np.concatenate([np.asarray(p, np.int64) for p in positions]) if positions else np.empty(0, np.int64)
    declared = sum(int(e["skips"]) for e in entries)
    if len(array) != declared:
        raise ValueError(f"manifest of tier {tier}: {declared} skip positions declared, {len(array)} given")
    return encode_head(tier, entries, refused, extra) + np.ascontiguousarray(array, "<i8").tobytes()


def encode_head(tier: int, entries: list[dict[str, Any]], refused: dict[str, str], extra: dict | None = None) -> bytes:
    """Everything of a part or manifest before its positions (entries get their offsets)."""
    offset, streams = 0, []
    for e in entries:
        streams.append({**e, "offset": offset})
        offset += int(e["skips"])
    header = {"format_version": FORMAT_VERSION, "tier": int(tier), "count": offset, "streams": streams,
              "refused": dict(sorted(refused.items())), **(extra or {})}
    return frame_head(MAGIC, header)


def _checked(header: dict, where: str) -> dict:
    if header.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{where}: corpus manifest format {header.get('format_version')!r}, this loader reads "
                         f"{FORMAT_VERSION}: upgrade prx-corpus (or republish with `prx-corpus manifest`)")
    return header


@dataclass
class Manifest:
    """A tier's manifest, its skip positions mapped from a node-local file (pickles by path)."""

    name: str
    root: str
    path: str
    header: dict
    positions: np.ndarray

    @classmethod
    def open(cls, name: str, root: str, path: str) -> Manifest:
        header, positions = map_framed(path, MAGIC, "corpus manifest")
        return cls(name, root, path, _checked(header, path), positions)

    @property
    def tier(self) -> int:
        return int(self.header["tier"])

    @property
    def refused(self) -> dict[str, str]:
        return dict(self.header.get("refused") or {})

    def plans(self, sources: list[str] | None = None) -> list[StreamPlan]:
        wanted = None if sources is None else set(sources)
        out = []
        for s in self.header["streams"]:
            if wanted is None or s["source"] in wanted:
                skipped = self.positions[s["offset"]:s["offset"] + s["skips"]]
                out.append(StreamPlan(s["source"], self.tier, s["width"], s["height"], join_uri(self.root, s["path"]),
                                      s["count"], skipped, s["index_digest"], s["shards_digest"], dict(s["skipped"])))
        return out

    def __getstate__(self) -> dict[str, Any]:  # a spawned dataloader worker maps the file again
        return {k: v for k, v in self.__dict__.items() if k != "positions"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.positions = map_framed(self.path, MAGIC, "corpus manifest")[1]


def read_manifest_header(root: str, tier: int, name: str, storage_options: dict | None = None) -> dict:
    """A manifest's header only (its streams and refusals, not their positions): one or two reads."""
    return read_framed_header(filesystem_for(root, storage_options), join_uri(tier_folder(root, tier), name))[0]


def read_framed_header(fs: Any, uri: str) -> tuple[dict, int]:
    """A part's or a manifest's header and the byte offset of its positions."""
    with fs.open(uri, "rb") as handle:
        header, offset = read_head(handle, MAGIC, "corpus manifest", uri)
    return _checked(header, uri), offset


def current_name(root: str, tier: int, storage_options: dict | None = None) -> str:
    """The name of the tier's current manifest (one small GET)."""
    fs = filesystem_for(root, storage_options)
    uri = join_uri(tier_folder(root, tier), CURRENT)
    try:
        pointer = json.loads(fs.cat_file(uri))
    except FileNotFoundError:
        raise MissingManifest(f"tier {tier} has no corpus manifest under {root} ({uri} is missing): materialize "
                              "mds_shards and skip_lists for its sources (each run publishes the manifest), or run "
                              "`prx-corpus manifest` once for a corpus written before manifests") from None
    return str(pointer["manifest"])


def load_manifest(root: str, tier: int, name: str | None = None, storage_options: dict | None = None,
                  cache_dir: str | None = None) -> Manifest:
    """The tier's manifest (`name`, default the current one), mapped: from the root itself when it
    is local, else from one copy per node under `cache_dir`, fetched by the first rank while the
    node's others wait, checked against the digest its name carries."""
    name = name or current_name(root, tier, storage_options)
    uri = join_uri(tier_folder(root, tier), name)
    fs = filesystem_for(root, storage_options)
    if not is_remote(root):
        if not os.path.exists(uri):
            raise MissingManifest(f"corpus manifest {uri} is missing (pruned after its retention, or never "
                                  "written): use the current one (no `manifest=`) or republish")
        return Manifest.open(name, root, uri)
    if cache_dir is None:
        raise ValueError("a remote corpus root needs a cache_dir for its manifest")
    path = os.path.join(cache_dir, FOLDER, name)
    with node_lock(path):
        if not os.path.exists(path):
            try:
                fs.get_file(uri, f"{path}.tmp")
            except FileNotFoundError:
                raise MissingManifest(f"corpus manifest {uri} is missing (pruned after its retention): use the "
                                      "current one (no `manifest=`) or republish") from None
            with open(f"{path}.tmp", "rb") as handle:
                digest = hashlib.file_digest(handle, "sha256").hexdigest()
            if not name.startswith(f"m-{digest[:20]}"):
                os.remove(f"{path}.tmp")
                raise ValueError(f"corpus manifest {uri} does not hold what its name says (SHA-256 {digest[:20]}): "
                                 "a damaged copy; republish the tier's manifest with `prx-corpus manifest`")
            os.replace(f"{path}.tmp", path)
    return Manifest.open(name, root, path)


def check_indexes(plans: list[StreamPlan], paths: list[str], manifest: Manifest | None) -> None:
    """Refuse a stream whose index.json (as streaming loaded it: `paths`) is not the one its skips
    were computed for: republished after the manifest, so the skip positions would be wrong."""
    for plan, path in zip(plans, paths):
        with open(path, "rb") as handle:
            digest = hashlib.file_digest(handle, "sha256").hexdigest()
        if digest != plan.index_digest:
            where = f"manifest {manifest.name}" if manifest else "its skip-lists"
            raise UnfilteredStream(
                f"stream {plan.name} was republished after {where} (index {digest[:12]}, the skips were computed for "
                f"{plan.index_digest[:12]}): re-materialize skip_lists for {plan.source} (it publishes the tier's "
                "manifest), or pass allow_unfiltered=True to train on it unfiltered")

