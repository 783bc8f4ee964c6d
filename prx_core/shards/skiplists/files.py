"""Skip-lists: which samples of an MDS stream training must skip, and why.

Shards are never rewritten to drop a sample; a changed filter policy rewrites only these files,
per (stream, reason) under `<root>/skiplists/<source>/<tier>/<w>x<h>/`:

- `<reason>.skip`: the sorted stream indices to skip, a compact binary array a loader can
  memory-map: `PRXSKIP2`, a little-endian u32 header length, a JSON header (reason, policy
  version, stream, its size, count, and `index_digest`, the SHA-256 of the stream's index.json
  it was computed for), padded to 8 bytes, then `count` little-endian int64 indices.
- `<reason>.ids.parquet`: the same samples' `sample_id`s, aligned, for audits (never read by the
  training loader).

- `_complete.json` (`prx_core.shards.skiplists.records`): written last for every stream, also one with
  nothing to skip, so the loader can tell "nothing to skip" from "never computed".

The training loader unions a stream's reasons and refuses a stream without a record for its
current index.json, or a list whose `index_digest` is not its stream's. Files carry no timestamp:
a rerun with the same policy writes identical bytes.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Sequence
from dataclasses import dataclass

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from prx_core.shards.framed import frame, map_framed, read_header
from prx_core.shards.skiplists.records import RECORD, write_record
from prx_core.store.names import validate_source_name
from prx_core.store.storage import filesystem_for, is_remote, join_uri, normalize_root, put_atomic

REASONS = ("duplicate", "text", "nsfw", "opt_out", "unlabelled")
CREATED_BY = "prx-corpus"
FORMAT_VERSION = 2
MAGIC = b"PRXSKIP2"
SUFFIX = ".skip"
IDS_SUFFIX = ".ids.parquet"


def stream_key(source: str, tier: int, width: int, height: int) -> str:
    """`<source>/<tier>/<w>x<h>`: how a skip-list and the loader's stream plan find each other."""
    return f"{validate_source_name(source)}/{int(tier)}/{int(width)}x{int(height)}"


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
    index_digest: str = ""  # SHA-256 of the stream's index.json the indices refer to

    def __post_init__(self) -> None:  # accept lists and arrays, keep the value hashable
        object.__setattr__(self, "indices", tuple(int(i) for i in self.indices))
        object.__setattr__(self, "sample_ids", tuple(self.sample_ids))

    @property
    def stream(self) -> str:
        return stream_key(self.source, self.tier, self.width, self.height)

    @property
    def fraction(self) -> float:
        """Share of the stream skipped for this reason (the loader over-samples by this much)."""
        return len(self.indices) / self.stream_size if self.stream_size else 0.0

    def header(self) -> dict:
        return {"format_version": FORMAT_VERSION, "created_by": CREATED_BY, "reason": self.reason,
                "policy_version": self.policy_version, "stream": self.stream, "source": self.source,
                "tier": self.tier, "width": self.width, "height": self.height, "stream_size": self.stream_size,
                "count": len(self.indices), "index_digest": self.index_digest}

    def validate(self) -> None:
        """Raise ValueError naming the stream and reason when the list is not usable as is."""
        validate_header(self.header(), np.asarray(self.indices, np.int64), f"skip-list {self.stream} {self.reason!r}")
        if len(self.indices) != len(self.sample_ids):
            raise ValueError(f"skip-list {self.stream} {self.reason!r}: {len(self.indices)} indices but "
                             f"{len(self.sample_ids)} sample_ids")


def validate_header(header: dict, indices: np.ndarray, where: str) -> None:
    if header.get("reason") not in REASONS:
        raise ValueError(f"{where}: unknown reason; known reasons are {REASONS}")
    if not isinstance(header.get("policy_version"), str) or not header["policy_version"]:
        raise ValueError(f"{where}: policy_version must be a non-empty string")
    if not all(isinstance(header.get(k), int) and not isinstance(header[k], bool) and header[k] > 0
               for k in ("tier", "width", "height")):
        raise ValueError(f"{where}: tier, width and height must be positive integers")
    size = header.get("stream_size")
    if not isinstance(size, int) or size < 0:
        raise ValueError(f"{where}: stream_size must be a non-negative integer")
    if header.get("count") != len(indices):
        raise ValueError(f"{where}: header count {header.get('count')} != {len(indices)} indices")
    if len(indices) and (np.any(np.diff(indices) <= 0) or indices[0] < 0 or indices[-1] >= size):
        raise ValueError(f"{where}: indices must be sorted, unique and lie in [0, {size})")


def encode(header: dict, indices: np.ndarray) -> bytes:
    """The `.skip` bytes (`prx_core.shards.framed`): magic, header, int64 indices."""
    return frame(MAGIC, header, indices)


def decode_header(data: bytes, where: str) -> tuple[dict, int]:
    """(header, byte offset of the indices) from the start of a `.skip` file."""
    header, offset = read_header(data, MAGIC, "skip-list", where)
    if not header:
        raise ValueError(f"{where}: truncated skip-list header")
    return header, offset


def decode(data: bytes, where: str) -> tuple[dict, np.ndarray]:
    header, offset = decode_header(data, where)
    if offset > len(data) or (len(data) - offset) % 8:
        raise ValueError(f"{where}: truncated skip-list ({len(data)} bytes)")
    indices = np.frombuffer(data, "<i8", offset=offset)
    validate_header(header, indices, where)
    return header, indices


def open_indices(path: str, where: str | None = None) -> tuple[dict, np.ndarray]:
    """A local `.skip` file, its indices memory-mapped: every process reading it shares the pages."""
    header, indices = map_framed(path, MAGIC, "skip-list", where)
    validate_header(header, indices, where or path)
    return header, indices


def skiplist_uri(root: str, source: str, tier: int, width: int, height: int, reason: str) -> str:
    return join_uri(stream_folder(root, source, tier, width, height), f"{reason}{SUFFIX}")


def stream_folder(root: str, source: str, tier: int, width: int, height: int) -> str:
    return join_uri(source_folder(root, source), str(int(tier)), f"{int(width)}x{int(height)}")


def source_folder(root: str, source: str) -> str:
    """`<root>/skiplists/<source>`: the only place a source's skip-list paths start from, so a
    name that is not a catalog name (`..`, `a/b`) never becomes a path to write or delete."""
    return join_uri(normalize_root(root), "skiplists", validate_source_name(source))


def write_stream_lists(fs: fsspec.AbstractFileSystem, folder: str, header: dict,
                       lists: dict[str, tuple[np.ndarray, pa.Array]], applied: Sequence[str] = ()) -> list[str]:
    """Replace every skip-list of one stream folder: `lists` maps a reason to its sorted indices and
    aligned sample ids; `header` holds the stream's fields. Reasons absent (or empty) lose their
    files. Each file is replaced atomically, then the stream's completion record (the reasons the
    policy `applied`, with their counts) is written last; returns the `.skip` URIs written."""
    written = []
    for reason, (indices, sample_ids) in sorted(lists.items()):
        if not len(indices):
            continue
        full = {**header, "format_version": FORMAT_VERSION, "created_by": CREATED_BY, "reason": reason,
                "count": len(indices)}
        validate_header(full, indices, f"skip-list {header['stream']} {reason!r}")
        uri = join_uri(folder, f"{reason}{SUFFIX}")
        buffer = io.BytesIO()
        pq.write_table(pa.table({"index": pa.array(indices, pa.int64()), "sample_id": sample_ids}), buffer)
        put_atomic(fs, join_uri(folder, f"{reason}{IDS_SUFFIX}"), buffer.getvalue())
        put_atomic(fs, uri, encode(full, indices))
        written.append(uri)
    keep = {w[: -len(SUFFIX)] for w in written} | {join_uri(folder, RECORD)}
    fs.invalidate_cache()
    for path in fs.ls(folder, detail=False) if fs.exists(folder) else []:
        uri = join_uri(folder, path.rstrip("/").rsplit("/", 1)[-1])
        if uri.removesuffix(SUFFIX).removesuffix(IDS_SUFFIX) not in keep:
            fs.rm(uri, recursive=True)
    write_record(fs, folder, header, [*applied, *lists], {r: len(v[0]) for r, v in lists.items()})
    return written


def remove_stale_streams(fs: fsspec.AbstractFileSystem, root: str, source: str,
                         keep: set[tuple[int, int, int]]) -> None:
    """Delete the skip-lists of the source's streams not in `keep` (and any leftover file)."""
    base = source_folder(root, source)
    fs.invalidate_cache()
    if not fs.exists(base):
        return
    prefix = fs._strip_protocol(base).rstrip("/") + "/"
    for path in fs.find(base):
        parts = path[len(prefix):].split("/")
        size = parts[1].split("x") if len(parts) == 3 else []
        if len(size) != 2 or not parts[0].isdigit() or (int(parts[0]), int(size[0]), int(size[1])) not in keep:
            fs.rm_file(join_uri(base, path[len(prefix):]))
    if not is_remote(base):
        for dirpath, _, _ in sorted(os.walk(base), key=lambda w: -len(w[0])):
            if not os.listdir(dirpath):
                os.rmdir(dirpath)
    fs.invalidate_cache()


def list_skip_files(root: str, source: str | None = None, tier: int | None = None,
                    storage_options: dict | None = None) -> list[str]:
    """`.skip` URIs of one source (or all) and one tier (or all), sorted: one glob, no reads."""
    root = normalize_root(root)
    fs = filesystem_for(root, storage_options)
    fs.invalidate_cache()
    base = join_uri(root, "skiplists")
    prefix = fs._strip_protocol(base).rstrip("/") + "/"
    pattern = join_uri(base, validate_source_name(source) if source is not None else "*", "*" if tier is None else str(int(tier)), "*", f"*{SUFFIX}")
    return sorted(join_uri(base, p[len(prefix):]) for p in fs.glob(pattern)
                  if not p[len(prefix):].startswith("."))


def read_skip_lists(root: str, source: str | None = None, storage_options: dict | None = None,
                    tier: int | None = None, with_sample_ids: bool = True) -> list[SkipList]:
    """All skip-lists (of one source or every source, one tier or all), validated, in a stable
    order. For audits and small corpora: this holds every index in memory."""
    root = normalize_root(root)
    fs = filesystem_for(root, storage_options)
    out = []
    for uri in list_skip_files(root, source, tier, storage_options):
        header, indices = decode(fs.cat_file(uri), uri)
        skip = SkipList(header["source"], header["tier"], header["width"], header["height"], header["reason"],
                        header["policy_version"], indices.tolist(), [], header["stream_size"],
                        header.get("index_digest", ""))
        if uri != skiplist_uri(root, skip.source, skip.tier, skip.width, skip.height, skip.reason):
            raise ValueError(f"{uri}: header says {skip.stream} {skip.reason!r}, file is misplaced")
        if with_sample_ids:
            with fs.open(uri.removesuffix(SUFFIX) + IDS_SUFFIX, "rb") as handle:
                ids = pq.read_table(handle, pre_buffer=False)
            if ids["index"].to_pylist() != list(skip.indices):
                raise ValueError(f"{uri}: its sample ids file does not list the same indices")
            object.__setattr__(skip, "sample_ids", tuple(ids["sample_id"].to_pylist()))
        out.append(skip)
    return sorted(out, key=lambda s: (s.source, s.tier, s.width, s.height, s.reason))


def skipped_indices(root: str, source: str, tier: int, width: int, height: int,
                    storage_options: dict | None = None) -> set[int]:
    """Union over reasons of the stream's indices to skip (empty when it has no skip-list)."""
    out: set[int] = set()
    for indices in stream_skip_reasons(root, source, tier, width, height, storage_options).values():
        out.update(indices.tolist())
    return out


def stream_skip_reasons(root: str, source: str, tier: int, width: int, height: int,
                        storage_options: dict | None = None) -> dict[str, np.ndarray]:
    """reason -> the stream's sorted indices to skip for it (empty when it has no skip-list)."""
    fs = filesystem_for(normalize_root(root), storage_options)
    folder = stream_folder(root, source, tier, width, height)
    fs.invalidate_cache()
    out: dict[str, np.ndarray] = {}
    for path in fs.glob(join_uri(folder, f"*{SUFFIX}")) if fs.exists(folder) else []:
        header, indices = decode(fs.cat_file(path), path)
        out[header["reason"]] = indices
    return out


def index_digest(stream_uri: str, storage_options: dict | None = None) -> str:
    """What a skip-list of the stream must carry as `index_digest`: the SHA-256 of its index.json."""
    fs = filesystem_for(stream_uri, storage_options)
    fs.invalidate_cache()
    return digest_index(fs.cat_file(join_uri(stream_uri, "index.json")))


def digest_index(data: bytes) -> str:
    """The `index_digest` of a stream whose index.json is `data`: its SHA-256."""
    return hashlib.sha256(data).hexdigest()
