"""Two real processes writing one partition: the lock races of issue 23 (item 7), each against a
local root and the loopback S3 endpoint. A writer in another PID namespace is not seen as dead, a
skewed clock does not take over a fresh lock, a holder stopped past its ttl fails before it
commits (fencing), and a slow heartbeat never recreates a lock another writer released. Outcomes
are asserted (who holds, who committed), never durations."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import lance
import pytest
from lock_writer import commit

from prx_core.store import fencing
from prx_core.store.lock_objects import store_for
from prx_core.store.locks import LockLost, PartitionLock, PartitionLocked
from prx_core.store.partitions import rejects_predicate
from prx_core.store.storage import Storage, put_atomic

WRITER = Path(__file__).parents[1] / "lock_writer.py"
WAIT = 120.0  # seconds a step may take on a loaded machine before the test gives up


class Writer:
    """A `lock_writer.py` process: send it commands, wait for its answers."""

    def __init__(self, storage: Storage, ttl: float, **faults: Any) -> None:
        config = {"root": storage.root, "options": storage.storage_options, "ttl": ttl, "run": "the child", **faults}
        self.proc = subprocess.Popen([sys.executable, str(WRITER), json.dumps(config)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def send(self, command: str, expect: str | None = None) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.expect(expect or "")

    def expect(self, prefix: str) -> str:
        """The next answer starting with `prefix` (other lines, e.g. a heartbeat's, are kept in `seen`)."""
        deadline = time.monotonic() + WAIT
        while True:
            line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            self.seen.append(line)
            if line.startswith(prefix):
                return line

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("exit\n")
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture(params=["local", "s3"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "local":
        return Storage(str(tmp_path / "corpus"))
    import boto3

    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = f"races-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint["endpoint"], region_name="us-east-1").create_bucket(Bucket=bucket)
    return Storage(f"s3://{bucket}/corpus", endpoint["storage_options"])


@pytest.fixture
def writers() -> Any:
    started: list[Writer] = []

    def start(storage: Storage, ttl: float, **faults: Any) -> Writer:
        started.append(Writer(storage, ttl, **faults))
        return started[-1]

    yield start
    for writer in started:
        writer.close()


def take_over(storage: Storage, ttl: float = 60.0) -> PartitionLock:
    """The lock, once the other writer's has gone stale (bounded wait)."""
    deadline = time.monotonic() + WAIT
    while True:
        try:
            return PartitionLock(storage, "samples", "photos", ttl=ttl, run="the parent").acquire()
        except PartitionLocked:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


def committed(storage: Storage) -> list[str]:
    """The labels of the commits the partition holds (each commit replaces the previous)."""
    ds = lance.dataset(storage.lance_uri("rejects"), storage_options=storage.lance_storage_options())
    return sorted(ds.to_table(filter=rejects_predicate("photos", "samples")).column("sample_id").to_pylist())


def holder(storage: Storage) -> dict[str, Any] | None:
    held = store_for(storage).read(PartitionLock(storage, "samples", "photos").uri)
    return None if held is None else held.record


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.fixture(autouse=True)
def no_lock_left_held() -> Any:
    """A failed test must not leave a lock in this thread's context: later commits would check it."""
    yield
    for lock in fencing.held():
        fencing.drop(lock)
        lock._stop.set()  # type: ignore[attr-defined]


@pytest.mark.parametrize("other_namespace", [True, False])
def test_a_holder_in_another_pid_namespace_is_not_seen_as_dead(storage: Storage, writers: Any,
                                                               other_namespace: bool) -> None:
    """Same hostname (hostNetwork pods, `docker --network host`), another PID namespace: its pid
    means nothing here. Its lock holds until it expires; the same pid in our namespace is dead."""
    pid = dead_pid()
    child = writers(storage, 60, pid=pid, pid_ns="pid:[4026000001]" if other_namespace else None)
    child.send("acquire", "held")
    if other_namespace:
        assert (holder(storage) or {})["pid"] == pid  # a pid that no process here has
        with pytest.raises(PartitionLocked, match="is being written by the child"):
            PartitionLock(storage, "samples", "photos").acquire()
        assert child.send("release") == "released"
        return
    with PartitionLock(storage, "samples", "photos", run="the parent") as mine:  # our namespace, its pid gone
        assert (holder(storage) or {})["token"] == mine.token
        assert child.send("release") == "lost"  # the writer that was taken over fails


@pytest.mark.parametrize("who", ["challenger", "holder"])
def test_a_skewed_clock_does_not_take_over_a_fresh_lock(storage: Storage, writers: Any, who: str) -> None:
    """A challenger 400 s ahead (or a holder 400 s behind) used to read a heartbeat a second old
    as 400 s old; staleness now comes from the store's clock."""
    if who == "challenger":
        with PartitionLock(storage, "samples", "photos", ttl=60, run="the parent"):
            time.sleep(1)
            child = writers(storage, 60, skew=400)
            assert child.send("acquire").startswith("locked partition 'photos' of asset 'samples' is being written "
                                                    "by the parent")
        return
    child = writers(storage, 60, skew=-400)
    child.send("acquire", "held")
    time.sleep(1)
    with pytest.raises(PartitionLocked, match="is being written by the child"):
        PartitionLock(storage, "samples", "photos").acquire()
    assert child.send("release") == "released"


def test_a_holder_stopped_past_its_ttl_fails_before_committing(storage: Storage, writers: Any) -> None:
    """SIGSTOP past the ttl, another writer takes over and commits, SIGCONT: the stopped writer's
    commit is refused (the fence), so the partition holds the other writer's commit only."""
    child = writers(storage, 2)
    child.send("acquire", "held")
    child.proc.send_signal(signal.SIGSTOP)
    try:
        mine = take_over(storage)
        commit(storage, "parent")
    finally:
        child.proc.send_signal(signal.SIGCONT)
    assert child.send("commit child") == "lost"  # it failed before its commit
    assert committed(storage) == ["parent"]
    assert (holder(storage) or {})["token"] == mine.token  # its lock untouched by the stopped writer
    mine.release()
    assert child.send("release") == "lost" and holder(storage) is None


def test_a_slow_heartbeat_never_recreates_a_released_lock(storage: Storage, writers: Any, tmp_path: Path) -> None:
    """The holder's heartbeat write is delayed until after another writer took the stale lock,
    committed and released it. The late write is a compare-and-swap: refused, no lock recreated,
    and the slow writer fails before its commit instead of both reporting success."""
    gate = tmp_path / "deliver-the-heartbeat"
    child = writers(storage, 2, beat_gate=str(gate))
    child.send("acquire", "held")
    mine = take_over(storage)
    commit(storage, "parent")
    mine.release()
    assert holder(storage) is None  # released
    gate.touch()
    assert child.expect("beat") == "beat refused"
    assert holder(storage) is None  # the late heartbeat did not recreate it
    assert child.send("commit child") == "lost"
    assert committed(storage) == ["parent"]


def test_the_fence_stops_every_commit_primitive_after_a_takeover(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """In one process: a lock whose heartbeat stalled past its ttl and was taken over refuses a
    Lance commit and an atomic publication (index.json, skip lists) in the thread that held it."""
    storage = Storage(str(tmp_path / "corpus"))
    stalled = threading.Event()
    monkeypatch.setattr(PartitionLock, "_heartbeat", lambda self: stalled.wait() or True)
    lock = PartitionLock(storage, "samples", "photos", ttl=1).acquire()
    commit(storage, "first")  # held: commits
    other = take_over(storage)
    with pytest.raises(LockLost, match="rerun the partition"):
        commit(storage, "second")
    with pytest.raises(LockLost):
        put_atomic(storage.filesystem(), storage.uri("index.json"), b"{}")
    assert committed(storage) == ["first"] and not Path(storage.uri("index.json")).exists()
    stalled.set()
    with pytest.raises(LockLost):
        lock.release()
    other.release()
    commit(storage, "third")  # no lock held in this context any more: the fence has nothing to check
    assert committed(storage) == ["third"]
