"""Skip-lists: which samples of an MDS stream training must skip, and why.

Shards are never rewritten to drop a sample; a changed filter policy rewrites only these small
files, one per (stream, reason) at `<root>/skiplists/<source>/<tier>/<w>x<h>/<reason>.json`.
The training loader unions a stream's reasons (`skipped_indices`). Files carry no timestamp so a
rerun with the same policy rewrites identical bytes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import fsspec

from prx_core.store.storage import filesystem_for, is_remote, join_uri, put_atomic

REASONS = ("duplicate", "text", "nsfw", "opt_out")
CREATED_BY = "prx-corpus"
FORMAT_VERSION = 1


def stream_key(source: str, tier: int, width: int, height: int) -> str:
    """`<source>/<tier>/<w>x<h>`: how a skip-list and the loader's stream plan find each other."""
    return f"{source}/{int(tier)}/{int(width)}x{int(height)}"


@dataclass(frozen=True)
class SkipList:
    """Sorted, unique stream indices to skip for one reason, with their aligned sample ids."""

    source: str
    tier: int
    width: int
    height: int
    reason: str
    policy_version: str
    indices: tuple[int, ...]
    sample_ids: tuple[str, ...]
    stream_size: int

    def __post_init__(self) -> None:  # accept lists, keep the value hashable
        object.__setattr__(self, "indices", tuple(self.indices))
        object.__setattr__(self, "sample_ids", tuple(self.sample_ids))

    @property
    def stream(self) -> str:
        return stream_key(self.source, self.tier, self.width, self.height)

    @property
    def fraction(self) -> float:
        """Share of the stream skipped for this reason (the loader over-samples by this much)."""
        return len(self.indices) / self.stream_size if self.stream_size else 0.0

    def validate(self) -> None:
        """Raise ValueError naming the stream and reason when the list is not usable as is."""
        where = f"skip-list {self.stream} {self.reason!r}"
        if self.reason not in REASONS:
            raise ValueError(f"{where}: unknown reason; known reasons are {REASONS}")
        if not isinstance(self.policy_version, str) or not self.policy_version:
            raise ValueError(f"{where}: policy_version must be a non-empty string")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                   for v in (self.tier, self.width, self.height)):
            raise ValueError(f"{where}: tier, width and height must be positive integers")
        if not isinstance(self.stream_size, int) or self.stream_size < 0:
            raise ValueError(f"{where}: stream_size must be a non-negative integer")
        if len(self.indices) != len(self.sample_ids):
            raise ValueError(f"{where}: {len(self.indices)} indices but {len(self.sample_ids)} sample_ids")
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in self.indices):
            raise ValueError(f"{where}: indices must be integers")
        if any(b <= a for a, b in zip(self.indices, self.indices[1:])):
            raise ValueError(f"{where}: indices must be sorted and unique")
        if self.indices and (self.indices[0] < 0 or self.indices[-1] >= self.stream_size):
            raise ValueError(f"{where}: indices must lie in [0, {self.stream_size})")


def skiplist_uri(root: str, source: str, tier: int, width: int, height: int, reason: str) -> str:
    return join_uri(_normalize(root), "skiplists", source, str(int(tier)), f"{int(width)}x{int(height)}",
                    f"{reason}.json")


def _normalize(root: str) -> str:
    return root if is_remote(root) else os.path.abspath(os.path.expanduser(root))


def _encode(skip: SkipList) -> bytes:
    header = {
        "format_version": FORMAT_VERSION, "created_by": CREATED_BY, "reason": skip.reason,
        "policy_version": skip.policy_version, "stream": skip.stream, "source": skip.source,
        "tier": skip.tier, "width": skip.width, "height": skip.height,
        "stream_size": skip.stream_size, "count": len(skip.indices),
    }
    body = {"header": header, "indices": list(skip.indices), "sample_ids": list(skip.sample_ids)}
    return (json.dumps(body, separators=(",", ":")) + "\n").encode()


def _decode(data: bytes, where: str) -> SkipList:
    try:
        obj = json.loads(data)
        header = obj["header"]
        skip = SkipList(header["source"], header["tier"], header["width"], header["height"],
                        header["reason"], header["policy_version"], obj["indices"], obj["sample_ids"],
                        header["stream_size"])
        count = header["count"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{where}: not a skip-list file ({type(exc).__name__}: {exc})") from exc
    skip.validate()
    if count != len(skip.indices):
        raise ValueError(f"{where}: header count {count} != {len(skip.indices)} indices")
    return skip


def _source_files(fs: fsspec.AbstractFileSystem, root: str, source: str) -> list[str]:
    """Every file under the source's skip-list folder, as URIs (temp leftovers included)."""
    base = join_uri(root, "skiplists", source)
    fs.invalidate_cache()
    if not fs.exists(base):
        return []
    prefix = fs._strip_protocol(base).rstrip("/") + "/"
    return [join_uri(base, p[len(prefix):]) for p in fs.find(base)]


def write_skip_lists(root: str, source: str, skip_lists: list[SkipList],
                     storage_options: dict | None = None) -> list[str]:
    """Replace all skip-lists of `source`; returns the URIs written, by (tier, w, h, reason).

    Everything is validated before anything is written. Empty lists are not written, so a reason
    that became empty (or a stream that disappeared) simply loses its file. Each file is replaced
    atomically; the set of files is not (a reader between two files may mix policy versions,
    which the header's policy_version makes visible).
    """
    root = _normalize(root)
    seen: set[tuple[int, int, int, str]] = set()
    for skip in skip_lists:
        skip.validate()
        if skip.source != source:
            raise ValueError(f"skip-list {skip.stream} {skip.reason!r}: source is not {source!r}")
        key = (skip.tier, skip.width, skip.height, skip.reason)
        if key in seen:
            raise ValueError(f"skip-list {skip.stream} {skip.reason!r}: given twice")
        seen.add(key)
    fs = filesystem_for(root, storage_options)
    written = []
    for skip in sorted(skip_lists, key=lambda s: (s.tier, s.width, s.height, s.reason)):
        if skip.indices:
            uri = skiplist_uri(root, source, skip.tier, skip.width, skip.height, skip.reason)
            put_atomic(fs, uri, _encode(skip))
            written.append(uri)
    keep = set(written)
    for uri in _source_files(fs, root, source):
        if uri not in keep:
            fs.rm_file(uri)
    if not is_remote(root):
        _remove_empty_dirs(join_uri(root, "skiplists", source))
    fs.invalidate_cache()
    return written


def _remove_empty_dirs(base: str) -> None:
    if not os.path.isdir(base):
        return
    for dirpath, _, _ in sorted(os.walk(base), key=lambda w: -len(w[0])):
        if not os.listdir(dirpath):
            os.rmdir(dirpath)


def _read_glob(fs: fsspec.AbstractFileSystem, pattern: str, root: str) -> list[SkipList]:
    base = join_uri(root, "skiplists")
    prefix = fs._strip_protocol(base).rstrip("/") + "/"
    out = []
    for path in sorted(fs.glob(pattern)):
        rel = path[len(prefix):]
        if rel.split("/")[0].startswith("."):
            continue
        uri = join_uri(base, rel)
        skip = _decode(fs.cat_file(path), uri)
        if uri != skiplist_uri(root, skip.source, skip.tier, skip.width, skip.height, skip.reason):
            raise ValueError(f"{uri}: header says {skip.stream} {skip.reason!r}, file is misplaced")
        out.append(skip)
    return sorted(out, key=lambda s: (s.source, s.tier, s.width, s.height, s.reason))


def read_skip_lists(root: str, source: str | None = None,
                    storage_options: dict | None = None) -> list[SkipList]:
    """All skip-lists (of one source, or of every source), validated, in a stable order."""
    root = _normalize(root)
    fs = filesystem_for(root, storage_options)
    fs.invalidate_cache()
    return _read_glob(fs, join_uri(root, "skiplists", source or "*", "*", "*", "*.json"), root)


def skipped_indices(root: str, source: str, tier: int, width: int, height: int,
                    storage_options: dict | None = None) -> set[int]:
    """Union over reasons of the stream's indices to skip (empty when it has no skip-list)."""
    root = _normalize(root)
    fs = filesystem_for(root, storage_options)
    fs.invalidate_cache()
    folder = join_uri(root, "skiplists", source, str(int(tier)), f"{int(width)}x{int(height)}")
    out: set[int] = set()
    for skip in _read_glob(fs, join_uri(folder, "*.json"), root):
        out.update(skip.indices)
    return out
