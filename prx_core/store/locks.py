"""Per-partition write locks: at most one writer of an (asset, partition) commits at a time.

Two runs of one partition at once corrupt it (both replaces of a new partition commit; one run's
cleanup deletes the other's staging), so every writing stage holds a lock object under the root,
`<root>/_locks/<asset>/<partition>.lock` (JSON: token, run, host, boot id, PID namespace, pid,
since, beat, ttl). Every change to it is a compare-and-swap on the version last seen
(`lock_objects`): created only if absent, refreshed by a heartbeat every `ttl / 3` seconds only
while it still holds what this writer wrote, taken over only while it still holds what was judged
stale, deleted only if it is still ours. So a slow heartbeat never recreates a lock another writer
released, and two breakers never both win.

A lock is stale when the store's own clock says it was last written more than its `ttl` ago (no
writer's wall clock is compared with another's), or at once when its holder ran on this host, in
this boot and in this PID namespace, and its process is gone.

Fencing: a writer checks its locks right before every commit (`fencing.ensure_held`, called by
the commit primitives). It fails with `LockLost` if its lock was taken over, or if it went longer
than `ttl` without a confirmed heartbeat (e.g. stopped): a writer that lost its lock never commits.
An object store is probed once for conditional writes; one that ignores them is refused unless
`PRX_LOCK_BEST_EFFORT=1` (then a loud warning: locking is best effort there).
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from prx_core.store.names import validate_source_name
from prx_core.store import fencing, lock_objects
from prx_core.store.lock_objects import Held, LockStore
from prx_core.store.storage import Storage

log = logging.getLogger(__name__)

LOCKS = "_locks"
TTL_SECONDS = float(os.environ.get("PRX_LOCK_TTL_SECONDS", "300"))
BEST_EFFORT_ENV = "PRX_LOCK_BEST_EFFORT"
# who is writing, for the message another writer gets (a Dagster asset sets its run id here)
RUN_LABEL: contextvars.ContextVar[str | None] = contextvars.ContextVar("prx_run_label", default=None)

class PartitionLocked(RuntimeError):
    """Another writer holds the partition: the message says who and since when."""


class LockLost(RuntimeError):
    """This writer's lock expired or was taken over while it ran: it must not commit, and its run is rerun."""


class LockUnsupported(RuntimeError):
    """The object store ignores conditional writes: a lock there cannot exclude a second writer."""


def identity() -> dict[str, Any]:
    """Who this process is, as far as another process can check it: a pid means something only
    on the same host, in the same boot and in the same PID namespace."""
    return {"host": socket.gethostname(), "boot_id": _read_text("/proc/sys/kernel/random/boot_id"),
            "pid_ns": _link("/proc/self/ns/pid"), "pid": os.getpid(), "started": start_ticks(os.getpid())}


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
    _store: LockStore | None = field(default=None, repr=False)
    _version: str | None = field(default=None, repr=False)  # what this writer last wrote
    _confirmed: float = field(default=0.0, repr=False)  # time.monotonic() before that write
    _beats: int = field(default=0, repr=False)
    _mutex: threading.Lock = field(default_factory=threading.Lock, repr=False)
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
        self._beats += 1
        return {"asset": self.asset, "partition": self.partition, "token": self.token, "run": self.run,
                **identity(), "since": self.since, "heartbeat": time.time(), "beat": self._beats, "ttl": self.ttl}

    def acquire(self) -> PartitionLock:
        """Take the lock or raise PartitionLocked naming the holder; a stale lock is taken over."""
        store = self._store = lock_objects.store_for(self.storage)
        require_conditions(store, self.storage)
        self.since = time.time()
        for _ in range(3):  # a lock released or taken by another in between: look again
            started = time.monotonic()
            try:
                version = self._take(store)
            except TimeoutError as exc:  # a holder stuck inside its compare-and-swap: it is there
                raise PartitionLocked(f"partition {self.partition!r} of asset {self.asset!r} is being written by "
                                      f"another writer ({exc}); retry") from exc
            if not isinstance(version, str):
                continue
            self._version, self._confirmed = version, started
            self._thread = threading.Thread(target=self._beat, name=f"lock-{self.asset}-{self.partition}", daemon=True)
            self._thread.start()
            fencing.hold(self)
            return self
        raise PartitionLocked(f"partition {self.partition!r} of asset {self.asset!r}: could not take its lock "
                              f"{self.uri} (it keeps changing hands); retry")

    def _take(self, store: LockStore) -> str | bool:
        """Create the lock, or take it over if stale: our version; False to look again (it changed hands)."""
        version = store.create(self.uri, _encode(self.record()))
        if version is not None:
            return version
        held = store.read(self.uri)
        if held is None:
            return False  # released in between
        if not is_stale(held, self.ttl):
            raise PartitionLocked(describe(self.asset, self.partition, held.record))
        version = store.swap(self.uri, _encode(self.record()), held.version)  # only the one judged stale
        if version is None:
            return False
        log.warning("%s: took over the stale lock of %s", self.uri, held.record.get("run") or "a writer")
        return version

    def renew(self) -> bool:
        """One heartbeat: rewrite the lock only if it still holds what we wrote; False once lost."""
        with self._mutex:
            if self.lost or self._store is None or self._version is None:
                return False
            started = time.monotonic()
            version = self._store.swap(self.uri, _encode(self.record()), self._version)
            if version is None:
                self.lost = True
                return False
            self._version, self._confirmed = version, started
            return True

    def ensure_held(self) -> None:
        """The fence before a commit: LockLost unless the lock is provably still ours. Within a third
        of the ttl of a confirmed heartbeat no one can have judged it stale; later, renew it first;
        past the ttl (stopped, starved, cut off) the writer has lost it, taken over or not."""
        elapsed = time.monotonic() - self._confirmed
        if not self.lost and elapsed > self.ttl:
            self.lost = True
        if self.lost or (elapsed > self.ttl / 3 and not self.renew()):
            raise LockLost(self._lost_message())

    def release(self) -> None:
        """Stop the heartbeat and delete the lock if it is still ours; LockLost if it was not."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        fencing.drop(self)
        with self._mutex:  # delete it if it still holds what we wrote, even after a stall (nobody took it)
            removed = self._store is not None and self._version is not None \
                and self._store.remove(self.uri, self._version)
            self.lost = self.lost or not removed
        if self.lost:
            raise LockLost(self._lost_message())

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                if not self._heartbeat():
                    return
            except Exception as exc:  # a store hiccup: the next beat retries; the fence judges by time
                log.warning("%s: heartbeat failed: %s", self.uri, exc)

    def _heartbeat(self) -> bool:
        return self.renew()

    def _lost_message(self) -> str:
        return (f"partition {self.partition!r} of asset {self.asset!r}: this writer lost its lock {self.uri} (no "
                f"confirmed heartbeat for over {self.ttl:.0f}s, or another writer took it over); it did not commit "
                "after that point, and another writer may have run: rerun the partition")

    def __enter__(self) -> PartitionLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def describe(asset: str, partition: str, holder: dict[str, Any]) -> str:
    try:
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(holder.get("since") or 0)))
    except (TypeError, ValueError, OverflowError):
        since = "an unknown time"
    return (f"partition {partition!r} of asset {asset!r} is being written by {holder.get('run') or 'another writer'} "
            f"since {since}; wait for it to finish (a crashed writer's lock expires "
            f"{_ttl_of(holder, TTL_SECONDS):.0f}s after its last heartbeat)")


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


@contextlib.contextmanager
def partition_locks(storage: Storage, partition: str, assets: Sequence[str], label: str) -> Iterator[None]:
    """Hold the locks of one partition of several assets (an operator's command: opt-out,
    rewrite-streams), taken in one fixed order so two such commands never deadlock."""
    with run_label(label), contextlib.ExitStack() as stack:
        for asset in sorted(set(assets)):
            stack.enter_context(partition_lock(storage, asset, partition))
        yield


# -- staleness and the store's conditions ---------------------------------------------------------------

def is_stale(held: Held, ttl: float) -> bool:
    """Stale by the store's clock (age past the holder's ttl), or a holder provably gone."""
    return held.age > _ttl_of(held.record, ttl) or process_gone(held.record)


def process_gone(holder: dict[str, Any]) -> bool:
    """The holder (an `identity()`) ran on this host, in this boot and PID namespace, and its
    process is gone: no such pid, or one started at another time (the pid was reused). False when
    that cannot be known here (another host or container)."""
    mine = identity()
    same = all(holder.get(k) and holder.get(k) == mine[k] for k in ("host", "boot_id", "pid_ns"))
    if not same or not isinstance(holder.get("pid"), int):
        return False
    pid = holder["pid"]
    reused = bool(holder.get("started")) and start_ticks(pid) not in ("", holder["started"])
    return not _alive(pid) or reused


def start_ticks(pid: int) -> str:
    """When the process started, in clock ticks since boot (/proc/<pid>/stat field 22); "" if unknown."""
    text = _read_text(f"/proc/{pid}/stat")
    fields = text.rsplit(")", 1)[-1].split()  # after the command name, which may hold spaces
    return fields[19] if len(fields) > 19 else ""


def require_conditions(store: LockStore, storage: Storage) -> None:
    """Refuse a store that ignores conditional writes, unless PRX_LOCK_BEST_EFFORT=1 says to go on."""
    endpoint = (storage.storage_options.get("client_kwargs") or {}).get("endpoint_url", "")
    if lock_objects.conditions_honoured(store, storage.uri(LOCKS, ".probe"), f"{endpoint}|{storage.root}"):
        return
    text = (f"the store of {storage.root} ignores conditional writes (If-None-Match / If-Match), so a partition "
            "lock there cannot keep two writers of one partition apart")
    if os.environ.get(BEST_EFFORT_ENV, "").lower() not in ("1", "true", "yes"):
        raise LockUnsupported(f"{text}; use a store that honours them (AWS S3, MinIO) or set "
                              f"{BEST_EFFORT_ENV}=1 to accept best-effort locking")
    log.warning("%s: LOCKING IS BEST EFFORT (%s=1); run one writer per partition yourself", text, BEST_EFFORT_ENV)


def _ttl_of(holder: dict[str, Any], default: float) -> float:
    try:
        return float(holder.get("ttl") or default)
    except (TypeError, ValueError):
        return default


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as exc:
        return exc.errno == errno.EPERM
    return True


def _read_text(path: str) -> str:
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return ""


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def _encode(record: dict[str, Any]) -> bytes:
    return json.dumps(record, sort_keys=True).encode()
