"""What the training loader keeps once per node: skip-lists memory-mapped from a node-local copy
(a remote root) and each stream's union of reasons, computed by the first rank that needs it while
the node's other ranks wait on a file lock, then mapped by all of them."""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from prx_core.shards.skiplists.files import open_indices
from prx_core.store.storage import is_remote


def default_cache_dir(root: str) -> str:
    return os.path.join(tempfile.gettempdir(), "prx-loader", hashlib.blake2s(root.encode(), digest_size=8).hexdigest())


def skip_union(fs: Any, uris: list[str], name: str, count: int, digest: str, cache: str) -> np.ndarray:
    """The sorted union of a stream's skip-lists, memory-mapped (one file per node)."""
    arrays, keys = [], []
    for uri in uris:
        header, indices = open_indices(_local(fs, uri, cache), uri)
        if header["stream_size"] != count or header.get("index_digest") != digest:
            raise ValueError(f"skip-list {uri} was computed for another version of stream {name} "
                             f"({header['stream_size']} samples, index {header.get('index_digest', '?')[:12]}; the "
                             f"stream has {count}, index {digest[:12]}): re-materialize skip_lists for {name.split('/')[0]}")
        arrays.append(indices)
        keys.append(f"{header['reason']}:{header['policy_version']}:{header['count']}:{_fingerprint(fs, uri)}")
    if len(arrays) <= 1:
        return arrays[0] if arrays else np.empty(0, np.int64)
    path = os.path.join(cache, "skip-unions", name, hashlib.sha256("|".join([digest, *keys]).encode()).hexdigest()[:24] + ".npy")
    with node_lock(path):
        if not os.path.exists(path):
            tmp = f"{path}.{os.getpid()}.tmp.npy"
            np.save(tmp, np.unique(np.concatenate(arrays)))
            os.replace(tmp, path)
    return np.load(path, mmap_mode="r")


def _fingerprint(fs: Any, uri: str) -> str:
    info = fs.info(uri)
    return str(info.get("ETag") or f"{info.get('size')}-{info.get('mtime') or info.get('LastModified')}")


def _local(fs: Any, uri: str, cache: str) -> str:
    """A local path of a `.skip` file: itself for a local root, else a per-node cached copy keyed by
    the object's fingerprint (a rewritten list gets a new copy)."""
    if not is_remote(uri):
        return uri
    key = hashlib.sha256(f"{uri}|{_fingerprint(fs, uri)}".encode()).hexdigest()[:24]
    path = os.path.join(cache, "skiplists", f"{key}.skip")
    with node_lock(path):
        if not os.path.exists(path):
            fs.get_file(uri, f"{path}.tmp")
            os.replace(f"{path}.tmp", path)
    return path


@contextmanager
def node_lock(path: str) -> Iterator[None]:
    """Ranks of one node take turns on a cache file: the first writes it, the others map it."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(f"{path}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
