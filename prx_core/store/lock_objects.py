"""The lock objects of `prx_core.store.locks` on the two kinds of storage: local files (atomic
create with O_CREAT|O_EXCL) and object stores (S3: conditional PUTs, `If-None-Match: *` to create
and `If-Match: <etag>` to refresh; others: best effort)."""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from typing import Any

import fsspec

from prx_core.store.storage import Storage, is_remote, naming_full_disk


class LocalStore:
    """create (atomic, False when it exists), read -> (record, modified time), refresh, delete."""

    def __init__(self, fs: fsspec.AbstractFileSystem) -> None:
        self.fs = fs

    def create(self, uri: str, data: bytes) -> bool:
        os.makedirs(os.path.dirname(uri), exist_ok=True)
        try:
            fd = os.open(uri, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        try:
            with naming_full_disk(uri), os.fdopen(fd, "wb") as handle:
                handle.write(data)
        except OSError:  # a full disk: leave no empty lock that would hold the partition
            os.remove(uri)
            raise
        return True

    def read(self, uri: str) -> tuple[dict[str, Any], float] | None:
        try:
            with open(uri, "rb") as handle:
                data, modified = handle.read(), os.fstat(handle.fileno()).st_mtime
        except FileNotFoundError:
            return None
        return decode(data), modified

    def refresh(self, uri: str, data: bytes) -> None:
        tmp = f"{uri}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "wb") as handle:
            handle.write(data)
        os.replace(tmp, uri)

    def delete(self, uri: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(uri)


class ObjectStore(LocalStore):
    """S3 (conditional PUTs: create if absent, heartbeat if unchanged) and, best effort, any other
    fsspec object store."""

    def __init__(self, fs: fsspec.AbstractFileSystem) -> None:
        super().__init__(fs)
        self.s3 = "s3" in ((fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol)
        self.etags: dict[str, str] = {}  # of the last read: a heartbeat overwrites only that version

    def create(self, uri: str, data: bytes) -> bool:
        if not self.s3:
            if self.read(uri) is not None:
                return False
            self.fs.pipe_file(uri, data)  # best effort: no atomic create on this store
            return True
        try:
            self.fs.pipe_file(uri, data, mode="create")
        except FileExistsError:
            return False
        return True

    def read(self, uri: str) -> tuple[dict[str, Any], float] | None:
        self.fs.invalidate_cache(uri)
        try:
            data = self.fs.cat_file(uri)
            info = self.fs.info(uri)
        except FileNotFoundError:
            return None
        self.etags[uri] = info.get("ETag") or ""
        modified = info.get("LastModified") or info.get("mtime") or info.get("created")
        stamp = modified.timestamp() if hasattr(modified, "timestamp") else float(modified or 0)
        return decode(data), stamp

    def refresh(self, uri: str, data: bytes) -> None:
        etag = self.etags.get(uri)
        self.fs.pipe_file(uri, data, **({"IfMatch": etag} if self.s3 and etag else {}))

    def delete(self, uri: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(uri)


def decode(data: bytes) -> dict[str, Any]:
    try:
        record = json.loads(data)
    except ValueError:
        return {}  # a torn or foreign file: no token, so it can only expire
    return record if isinstance(record, dict) else {}


def store_for(storage: Storage) -> LocalStore:
    return ObjectStore(storage.filesystem()) if is_remote(storage.root) else LocalStore(storage.filesystem())
