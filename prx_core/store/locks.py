"""Per-partition write locks: at most one writer of an (asset, partition) at a time, whoever runs it.

Two runs of one partition at once corrupt it (both replaces of a new partition commit; one run's
cleanup deletes the other's staging), so every writing stage holds a lock object under the root,
`<root>/_locks/<asset>/<partition>.lock` (JSON: token, run, host, pid, since, heartbeat, ttl),
created atomically (local files: O_CREAT|O_EXCL; S3: a PUT with `If-None-Match: *`, honoured by
AWS S3, MinIO and moto) and refreshed by a heartbeat thread every `ttl / 3` seconds. A lock is
stale when its storage modification time is older than `ttl`, or at once when its holder ran on
this host and its process is gone; one breaker at a time (`<lock>.break`) deletes it if it is
still the one judged stale. Other object stores: the same protocol, best effort (no atomic create).
A holder whose lock was taken over (stalled longer than `ttl`) fails when it releases, so its run
is rerun, never trusted. Dagster's run queue adds one run per partition (`dagster.yaml`).
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import functools
import inspect
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from prx_core.sources.catalog import validate_source_name
from prx_core.store.lock_objects import LocalStore, store_for
from prx_core.store.storage import Storage

LOCKS = "_locks"
TTL_SECONDS = float(os.environ.get("PRX_LOCK_TTL_SECONDS", "300"))
BREAKER_TTL_SECONDS = 60.0
# who is writing, for the message another writer gets (a Dagster asset sets its run id here)
RUN_LABEL: contextvars.ContextVar[str | None] = contextvars.ContextVar("prx_run_label", default=None)

F = TypeVar("F", bound=Callable[..., Any])


class PartitionLocked(RuntimeError):
    """Another writer holds the partition: the message says who and since when."""


class LockLost(RuntimeError):
    """This writer's lock expired and was taken over while it ran: its results are suspect."""


@dataclass
class PartitionLock:
    """The lock of one (asset, partition) under a corpus root; `acquire` / `release`, or `with`."""

    storage: Storage
    asset: str
    partition: str
    ttl: float = TTL_SECONDS
    run: str | None = None
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    lost: bool = False
    since: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        validate_source_name(self.asset)  # both are path segments under the root
        validate_source_name(self.partition)
        self.run = self.run or RUN_LABEL.get() or f"pid {os.getpid()} on {socket.gethostname()}"

    @property
    def uri(self) -> str:
        return self.storage.uri(LOCKS, self.asset, f"{self.partition}.lock")

    def record(self) -> dict[str, Any]:
        now = time.time()
        return {"asset": self.asset, "partition": self.partition, "token": self.token, "run": self.run,
                "host": socket.gethostname(), "pid": os.getpid(), "since": self.since or now,
                "heartbeat": now, "ttl": self.ttl}

    def acquire(self) -> PartitionLock:
        """Take the lock or raise PartitionLocked naming the holder; a stale lock is taken over."""
        store = store_for(self.storage)
        self.since = time.time()
        for _ in range(3):  # a stale lock broken by us or another breaker: try again
            if store.create(self.uri, _encode(self.record())):
                self._thread = threading.Thread(target=self._beat, name=f"lock-{self.asset}-{self.partition}",
                                                daemon=True)
                self._thread.start()
                return self
            held = store.read(self.uri)
            if held is None:
                continue  # released in between
            holder, modified = held
            if not _stale(holder, modified, self.ttl):
                raise PartitionLocked(describe(self.asset, self.partition, holder))
            _break(store, self.uri, holder)
        raise PartitionLocked(f"partition {self.partition!r} of asset {self.asset!r}: could not take its lock "
                              f"{self.uri} (it keeps changing hands); retry")

    def release(self) -> None:
        """Stop the heartbeat and delete the lock if it is still ours; LockLost if it was not."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        store = store_for(self.storage)
        held = store.read(self.uri)
        if held is not None and held[0].get("token") == self.token:
            store.delete(self.uri)
        elif not self.lost:
            self.lost = True
        if self.lost:
            raise LockLost(f"partition {self.partition!r} of asset {self.asset!r}: the lock {self.uri} expired "
                           f"(no heartbeat for {self.ttl:.0f}s) and was taken over while this run wrote; another "
                           "writer may have run at the same time: rerun the partition")

    def _beat(self) -> None:
        store = store_for(self.storage)
        while not self._stop.wait(self.ttl / 3):
            held = store.read(self.uri)
            if held is None or held[0].get("token") != self.token:
                self.lost = True
                return
            with contextlib.suppress(OSError):
                store.refresh(self.uri, _encode(self.record()))

    def __enter__(self) -> PartitionLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def describe(asset: str, partition: str, holder: dict[str, Any]) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(holder.get("since") or 0)))
    return (f"partition {partition!r} of asset {asset!r} is being written by {holder.get('run') or 'another writer'} "
            f"since {since}; wait for it to finish (a crashed writer's lock expires "
            f"{float(holder.get('ttl') or TTL_SECONDS):.0f}s after its last heartbeat)")


@contextlib.contextmanager
def partition_lock(storage: Storage, asset: str, partition: str, ttl: float = TTL_SECONDS) -> Iterator[PartitionLock]:
    """Hold the lock of (asset, partition) for the block."""
    lock = PartitionLock(storage, asset, partition, ttl).acquire()
    try:
        yield lock
    finally:
        lock.release()


@contextlib.contextmanager
def run_label(label: str) -> Iterator[None]:
    """Name the writer (e.g. `dagster run <id>`) in the locks taken inside the block."""
    reset = RUN_LABEL.set(label)
    try:
        yield
    finally:
        RUN_LABEL.reset(reset)


def exclusive(asset: str, partition: str | None = None) -> Callable[[F], F]:
    """Decorate a stage entry point taking `source` (a name) or `spec` (a SourceSpec) and `storage`:
    the source name is validated before anything else, then the call holds the partition's lock
    (`partition` names the one lock of an unpartitioned stage)."""

    def decorate(fn: F) -> F:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs).arguments
            source = partition or (bound["source"] if "source" in bound else getattr(bound.get("spec"), "name", None))
            validate_source_name(source)
            with partition_lock(bound["storage"], asset, source):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


# -- staleness and breaking ---------------------------------------------------------------------------

def _encode(record: dict[str, Any]) -> bytes:
    return json.dumps(record, sort_keys=True).encode()


def _stale(holder: dict[str, Any], modified: float, ttl: float) -> bool:
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int) and not _alive(holder["pid"]):
        return True
    return time.time() - modified > float(holder.get("ttl") or ttl)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as exc:
        return exc.errno == errno.EPERM
    return True


def _break(store: LocalStore, uri: str, stale: dict[str, Any]) -> None:
    """Delete the stale lock at `uri`, one breaker at a time, only if it is still the stale one."""
    breaker = uri + ".break"
    if not store.create(breaker, _encode({"token": uuid.uuid4().hex, "since": time.time()})):
        held = store.read(breaker)
        if held is not None and time.time() - held[1] > BREAKER_TTL_SECONDS:
            store.delete(breaker)  # a breaker that died while breaking
        return
    try:
        held = store.read(uri)
        if held is not None and held[0].get("token") == stale.get("token"):
            store.delete(uri)
    finally:
        store.delete(breaker)
