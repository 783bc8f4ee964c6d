"""Rendered thumbnails kept on local disk, so a restarted (or second) explorer does not decode
again what it already rendered: at 100M images the in-memory cache holds a few thousand pages'
worth, the disk a day's browsing.

Keys are (content_id, size): content_id is the SHA-256 of the stored bytes, so a thumbnail never
goes stale and explorers of different roots can share one folder. A file name is a digest of the
key (never a path from the corpus). The folder is bounded in bytes: past the bound the least
recently used files (by modification time, refreshed on every hit) are removed down to 80%.
An empty file records an image that did not decode (`thumbnails.REFUSED`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 1 << 30
LOW_WATER = 0.8  # an eviction goes down to this fraction of the bound, so it is rare


class DiskThumbnails:
    """(content_id, size) -> JPEG bytes under `folder`, at most `max_bytes` in all; thread-safe.
    Disk errors are logged and read as misses: the cache never fails a request."""

    def __init__(self, folder: str | Path, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.folder, self.max_bytes = Path(folder), max_bytes
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.bytes = sum(size for _, size, _ in self._files())

    def path(self, key: tuple[str, int]) -> Path:
        digest = hashlib.sha256(f"{key[0]}\0{key[1]}".encode()).hexdigest()
        return self.folder / digest[:2] / f"{digest}.jpg"

    def get(self, key: tuple[str, int]) -> bytes | None:
        path = self.path(key)
        try:
            data = path.read_bytes()
            os.utime(path)  # recently used: the last to be evicted
            return data
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("thumbnail cache: reading %s failed: %s", path, exc)
            return None

    def put(self, key: tuple[str, int], value: bytes) -> None:
        path = self.path(key)
        try:
            path.parent.mkdir(exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".", delete=False) as out:
                out.write(value)
            os.replace(out.name, path)  # readers see the whole file or none
        except OSError as exc:
            log.warning("thumbnail cache: writing %s failed: %s", path, exc)
            return
        with self._lock:
            self.bytes += len(value)
            if self.bytes > self.max_bytes:
                self._evict()

    def _files(self) -> list[tuple[float, int, Path]]:
        found = []
        for entry in (e for d in os.scandir(self.folder) if d.is_dir() for e in os.scandir(d.path)):
            try:
                info = entry.stat()
            except FileNotFoundError:  # evicted by another explorer sharing the folder
                continue
            found.append((info.st_mtime, info.st_size, Path(entry.path)))
        return found

    def _evict(self) -> None:
        """Oldest first, down to LOW_WATER of the bound (one listing per eviction, not per put)."""
        files = sorted(self._files())
        total = sum(size for _, size, _ in files)
        for _, size, path in files:
            if total <= self.max_bytes * LOW_WATER:
                break
            path.unlink(missing_ok=True)
            total -= size
        self.bytes = total
