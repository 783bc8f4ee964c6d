"""The lock objects of `prx_core.store.locks` as compare-and-swap registers on the two kinds of storage.

Every operation is conditional on the version the caller last saw, so a slow writer can never
overwrite or recreate a lock another writer released or took over:
- local files: create by `link` (atomic, fails when it exists); swap and remove under an `flock`
  on `<lock>.guard`, only if the file's bytes still hash to the expected version;
- S3: `If-None-Match: *` to create, `If-Match: <etag>` to swap and to remove. A store that
  ignores those conditions is found by `conditions_honoured`, a probe run once per store.
A lock's age comes from the store's own clock (file mtime against a freshly touched file beside
it; S3 `LastModified` against the response's `Date`), never from a writer's wall clock.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import email.utils
import errno
import fcntl
import hashlib
import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import fsspec
import fsspec.asyn

from prx_core.store.storage import Storage, is_remote, naming_full_disk

GUARD_WAIT_SECONDS = 10.0


@dataclass(frozen=True)
class Held:
    """A lock object as read: its record, its version (what a swap or remove must match) and its
    age (seconds since its last write, by the store's clock)."""

    record: dict[str, Any]
    version: str
    age: float


class LocalStore:
    """Lock objects as local (or NFS) files."""

    honours_conditions = True

    def __init__(self, fs: fsspec.AbstractFileSystem) -> None:
        self.fs = fs

    def create(self, uri: str, data: bytes) -> str | None:
        """Write `uri` if it does not exist; its version, or None when it exists."""
        os.makedirs(os.path.dirname(uri), exist_ok=True)
        tmp = self._write_tmp(uri, data)
        try:
            os.link(tmp, uri)  # atomic and exclusive: no reader ever sees a half-written lock
        except FileExistsError:
            return None
        except OSError as exc:  # a file system without hard links: O_EXCL, under the guard
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise
            return self._create_exclusive(uri, data)
        finally:
            os.remove(tmp)
        return _digest(data)

    def _create_exclusive(self, uri: str, data: bytes) -> str | None:
        with self._guard(uri):  # readers of a half-written lock see no token: it only looks fresh
            try:
                fd = os.open(uri, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return None
            try:
                with naming_full_disk(uri), os.fdopen(fd, "wb") as handle:
                    handle.write(data)
            except OSError:  # a full disk: leave no empty lock that would hold the partition
                os.remove(uri)
                raise
        return _digest(data)

    def read(self, uri: str) -> Held | None:
        try:
            with open(uri, "rb") as handle:
                data, modified = handle.read(), os.fstat(handle.fileno()).st_mtime
        except FileNotFoundError:
            return None
        return Held(decode(data), _digest(data), max(0.0, self._now(uri) - modified))

    def swap(self, uri: str, data: bytes, version: str) -> str | None:
        """Replace `uri` by `data` only if it still holds `version`; the new version or None."""
        with self._guard(uri):
            if self._version(uri) != version:
                return None
            tmp = self._write_tmp(uri, data)
            os.replace(tmp, uri)
        return _digest(data)

    def remove(self, uri: str, version: str) -> bool:
        """Delete `uri` only if it still holds `version`."""
        with self._guard(uri):
            if self._version(uri) != version:
                return False
            os.remove(uri)
        return True

    def _version(self, uri: str) -> str | None:
        try:
            with open(uri, "rb") as handle:
                return _digest(handle.read())
        except FileNotFoundError:
            return None

    def _write_tmp(self, uri: str, data: bytes) -> str:
        tmp = f"{uri}.{uuid.uuid4().hex}.tmp"
        try:
            with naming_full_disk(uri), open(tmp, "wb") as handle:
                handle.write(data)
        except OSError:  # a full disk: leave nothing behind
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
            raise
        return tmp

    def _now(self, uri: str) -> float:
        """The file system's clock: the mtime of a file touched now beside the lock."""
        clock = os.path.join(os.path.dirname(uri), ".clock")
        with open(clock, "ab") as handle:
            os.utime(handle.fileno())
            return os.fstat(handle.fileno()).st_mtime

    @contextlib.contextmanager
    def _guard(self, uri: str) -> Iterator[None]:
        """One writer of `uri` at a time, across processes (flock; bounded wait)."""
        fd = os.open(uri + ".guard", os.O_CREAT | os.O_RDWR, 0o644)
        try:
            deadline = time.monotonic() + GUARD_WAIT_SECONDS
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(errno.ETIMEDOUT, f"the lock guard {uri}.guard stayed taken for "
                                           f"{GUARD_WAIT_SECONDS:.0f}s") from None
                    time.sleep(0.01)
            yield
        finally:
            os.close(fd)  # releases the flock


class S3Store:
    """Lock objects on S3 (and stores speaking its conditional-write API: MinIO, moto)."""

    REFUSED = {"PreconditionFailed", "NoSuchKey", "ConditionalRequestConflict", "404", "409", "412"}

    def __init__(self, fs: fsspec.AbstractFileSystem) -> None:
        self.fs = fs

    def create(self, uri: str, data: bytes) -> str | None:
        return self._put(uri, data, IfNoneMatch="*")

    def read(self, uri: str) -> Held | None:
        bucket, key, _ = self.fs.split_path(uri)
        try:
            data, etag, modified, date = fsspec.asyn.sync(self.fs.loop, self._get, bucket, key)
        except FileNotFoundError:
            return None
        now = email.utils.parsedate_to_datetime(date) if date else dt.datetime.now(dt.timezone.utc)
        return Held(decode(data), etag, max(0.0, (now - modified).total_seconds()))

    def swap(self, uri: str, data: bytes, version: str) -> str | None:
        return self._put(uri, data, IfMatch=version)

    def remove(self, uri: str, version: str) -> bool:
        bucket, key, _ = self.fs.split_path(uri)
        try:
            self.fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=version)
        except OSError as exc:
            if _s3_code(exc) in self.REFUSED:
                return False
            raise
        return True

    def _put(self, uri: str, data: bytes, **condition: str) -> str | None:
        bucket, key, _ = self.fs.split_path(uri)
        try:
            return str(self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **condition)["ETag"])
        except OSError as exc:
            if _s3_code(exc) in self.REFUSED:
                return None
            raise

    async def _get(self, bucket: str, key: str) -> tuple[bytes, str, dt.datetime, str | None]:
        response = await self.fs._call_s3("get_object", Bucket=bucket, Key=key)
        async with response["Body"] as body:
            data = await body.read()
        return data, str(response["ETag"]), response["LastModified"], \
            response["ResponseMetadata"]["HTTPHeaders"].get("date")


class UnconditionalStore(LocalStore):
    """Any other fsspec object store (GCS, Azure, memory): no conditional writes, best effort."""

    honours_conditions = False

    def create(self, uri: str, data: bytes) -> str | None:
        if self.fs.exists(uri):
            return None
        self.fs.pipe_file(uri, data)
        return _digest(data)

    def read(self, uri: str) -> Held | None:
        self.fs.invalidate_cache(uri)
        try:
            data, info = self.fs.cat_file(uri), self.fs.info(uri)
        except FileNotFoundError:
            return None
        modified = info.get("LastModified") or info.get("mtime") or info.get("created")
        stamp = modified.timestamp() if hasattr(modified, "timestamp") else float(modified or 0)
        return Held(decode(data), _digest(data), max(0.0, time.time() - stamp))

    def swap(self, uri: str, data: bytes, version: str) -> str | None:
        if self._version(uri) != version:
            return None
        self.fs.pipe_file(uri, data)
        return _digest(data)

    def remove(self, uri: str, version: str) -> bool:
        if self._version(uri) != version:
            return False
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(uri)
        return True

    def _version(self, uri: str) -> str | None:
        try:
            return _digest(self.fs.cat_file(uri))
        except FileNotFoundError:
            return None


LockStore = LocalStore | S3Store | UnconditionalStore
_PROBED: dict[str, bool] = {}
_PROBING = threading.Lock()


def conditions_honoured(store: LockStore, probe_dir: str, key: str) -> bool:
    """Whether the store refuses a create over an existing object, a swap and a remove of a version
    it does not hold: probed once per store (`key`: its endpoint and root) under `probe_dir`, then
    cached for the process."""
    if not isinstance(store, S3Store):
        return store.honours_conditions
    with _PROBING:
        if key not in _PROBED:
            _PROBED[key] = _probe(store, f"{probe_dir.rstrip('/')}/{uuid.uuid4().hex}")
        return _PROBED[key]


def _probe(store: S3Store, uri: str) -> bool:
    first = store.create(uri, b"{}")
    if first is None:
        return False
    try:
        wrong = '"00000000000000000000000000000000"'
        honoured = (store.create(uri, b'{"again": 1}') is None and store.swap(uri, b'{"wrong": 1}', wrong) is None
                    and not store.remove(uri, wrong))
        current = store.read(uri)
        return honoured and current is not None and current.version == first and store.remove(uri, first)
    finally:
        with contextlib.suppress(Exception):
            store.fs.rm_file(uri)


def _s3_code(exc: BaseException) -> str:
    """The S3 error code behind an s3fs error (it keeps the botocore error as the cause)."""
    cause: BaseException | None = exc
    while cause is not None:
        response = getattr(cause, "response", None)
        if isinstance(response, dict):
            error = response.get("Error") or {}
            return str(error.get("Code") or response.get("ResponseMetadata", {}).get("HTTPStatusCode") or "")
        cause = cause.__cause__
    return "404" if isinstance(exc, FileNotFoundError) else "412" if isinstance(exc, FileExistsError) else ""


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def decode(data: bytes) -> dict[str, Any]:
    try:
        record = json.loads(data)
    except ValueError:
        return {}  # a torn or foreign file: no token, so it can only expire
    return record if isinstance(record, dict) else {}


def store_for(storage: Storage) -> LockStore:
    fs = storage.filesystem()
    if not is_remote(storage.root):
        return LocalStore(fs)
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return S3Store(fs) if {"s3", "s3a"} & set(protocols) else UnconditionalStore(fs)
