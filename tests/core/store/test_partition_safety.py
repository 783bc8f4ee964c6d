"""A source name is a path segment: hostile names (`..`, `a/b`, ``) are refused by every prx_core
entry point before any I/O, and one partition has at most one writer at a time (a lock object
under the root changed only by compare-and-swap, with a heartbeat; a dead holder's lock is taken
over; a store that ignores conditional writes is refused). The races between two processes are in
test_lock_races.py."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import fsspec
import lance
import pytest
from PIL import Image

from prx_core.shards.mds.publish import write_source_streams
from prx_core.shards.mds.retention import prune_streams
from prx_core.shards.mds.streams import list_streams, stream_uri
from prx_core.shards.skiplists.files import list_skip_files, remove_stale_streams, stream_folder
from prx_core.shards.skiplists.publish import write_skip_lists
from prx_core.sources.catalog import SourceSpec, validate_source_name
from prx_core.stages.buckets import build_buckets
from prx_core.stages.caption_embeddings import build_caption_embeddings
from prx_core.stages.captions.stage import build_captions
from prx_core.stages.labels import build_labels
from prx_core.stages.mds_shards.stage import build_mds
from prx_core.stages.phashes import build_phashes
from prx_core.stages.samples.stage import build_samples
from prx_core.stages.skip_lists.stage import build_skip_lists
from prx_core.stages.source_embeddings import write_source_embeddings
from prx_core.store import lock_objects, locks
from prx_core.store.locks import LockLost, PartitionLock, PartitionLocked, partition_lock, run_label
from prx_core.store.partitions import source_predicate
from prx_core.store.storage import Storage

STORE_FOR = lock_objects.store_for
HOSTILE = ["..", "a/b", "", "../etc", ".", "A", "x\n", "x y"]


def tree(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))


@pytest.fixture
def corpus(tmp_path: Path) -> tuple[Path, Path]:
    """A corpus root holding a file and a sentinel beside it: both must survive every refusal."""
    root = tmp_path / "corpus"
    (root / "lance").mkdir(parents=True)
    (root / "lance" / "keep.txt").write_text("corpus data")
    (tmp_path / "sentinel.txt").write_text("outside the corpus")
    return root, tmp_path / "sentinel.txt"


@pytest.mark.parametrize("name", HOSTILE)
def test_write_skip_lists_refuses_a_hostile_source_and_deletes_nothing(corpus: tuple[Path, Path], name: str) -> None:
    root, sentinel = corpus
    before = tree(root.parent)
    with pytest.raises(ValueError, match="invalid source name"):
        write_skip_lists(str(root), name, [])  # `..` used to delete the whole corpus root
    with pytest.raises(ValueError, match="invalid source name"):
        remove_stale_streams(fsspec.filesystem("file"), str(root), name, set())
    assert tree(root.parent) == before and sentinel.read_text() == "outside the corpus"


@pytest.mark.parametrize("name", HOSTILE)
def test_path_and_predicate_builders_refuse_a_hostile_source(tmp_path: Path, name: str) -> None:
    builders: list[Callable[[], Any]] = [
        lambda: validate_source_name(name), lambda: source_predicate(name),
        lambda: stream_folder(str(tmp_path), name, 512, 512, 512), lambda: stream_uri(str(tmp_path), name, 512, 512, 512),
        lambda: list_streams(str(tmp_path), name), lambda: list_skip_files(str(tmp_path), name),
        lambda: prune_streams(str(tmp_path), source=name), lambda: write_source_streams([], str(tmp_path), name),
        lambda: PartitionLock(Storage(str(tmp_path)), "samples", name),
    ]
    for build in builders:
        with pytest.raises(ValueError, match="invalid source name"):
            build()
    assert validate_source_name("web_images_2") == "web_images_2"


STAGES: dict[str, Callable[[str, Storage], Any]] = {
    "samples": lambda name, storage: build_samples(SourceSpec(name, "imagefolder", "/"), storage),
    "buckets": lambda name, storage: build_buckets(name, storage),
    "phashes": lambda name, storage: build_phashes(name, storage),
    "captions": lambda name, storage: build_captions(name, storage, None),
    "caption_labels": lambda name, storage: build_labels(name, storage, "cap-v1", None),
    "caption_embeddings": lambda name, storage: build_caption_embeddings(name, storage, "cap-v1", None),
    "mds_shards": lambda name, storage: build_mds(name, storage, "cap-v1"),
    "skip_lists": lambda name, storage: build_skip_lists(name, storage, "cap-v1", "lab-v1", None),
    "source_embeddings": lambda name, storage: write_source_embeddings(name, storage, 1),
}


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_every_stage_refuses_a_hostile_source_before_any_io(corpus: tuple[Path, Path], stage: str) -> None:
    root, sentinel = corpus
    before = tree(root.parent)
    for name in ("..", "a/b", ""):
        with pytest.raises(ValueError, match="invalid source name"):
            STAGES[stage](name, Storage(str(root)))
    assert tree(root.parent) == before and sentinel.exists()  # not even a lock or a run folder


# -- the partition lock --------------------------------------------------------------------------------

def test_a_second_writer_is_refused_with_who_and_since(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path))
    with run_label("dagster run 1234abcd"), partition_lock(storage, "samples", "photos") as held:
        assert Path(held.uri) == tmp_path / "_locks" / "samples" / "photos.lock"
        with pytest.raises(PartitionLocked, match=r"partition 'photos' of asset 'samples' is being written by "
                                                  r"dagster run 1234abcd since \d{4}-\d\d-\d\d"):
            PartitionLock(storage, "samples", "photos").acquire()
        with partition_lock(storage, "samples", "other"), partition_lock(storage, "buckets", "photos"):
            pass  # other partitions, other assets: independent
    assert not Path(held.uri).exists()
    with partition_lock(storage, "samples", "photos"):  # released: free again
        pass


def race_for_lock(storage: Storage, writers: int) -> tuple[list[PartitionLock], list[str]]:
    """`writers` threads try to take one partition's lock at the same instant: the locks won and
    the refusals' messages."""
    won: list[PartitionLock] = []
    lost: list[str] = []
    barrier = threading.Barrier(writers)

    def take() -> None:
        lock = PartitionLock(storage, "samples", "photos")
        barrier.wait()
        try:
            won.append(lock.acquire())
        except PartitionLocked as exc:
            lost.append(str(exc))

    threads = [threading.Thread(target=take) for _ in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return won, lost


def test_racing_writers_get_exactly_one_lock(tmp_path: Path) -> None:
    won, lost = race_for_lock(Storage(str(tmp_path)), 8)
    assert (len(won), len(lost)) == (1, 7)
    won[0].release()


HOLD_AND_DIE = """
import os, sys
from prx_core.store.locks import PartitionLock
from prx_core.store.storage import Storage
PartitionLock(Storage(sys.argv[1]), "samples", "photos").acquire()
print(os.getpid(), flush=True)
os._exit(0)  # a crash: no release, the lock file stays
"""


def test_a_dead_holders_lock_does_not_block(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", HOLD_AND_DIE, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, check=True)
    lock = tmp_path / "_locks" / "samples" / "photos.lock"
    assert json.loads(lock.read_text())["pid"] == int(done.stdout)  # left behind by the crash
    with partition_lock(Storage(str(tmp_path)), "samples", "photos") as held:  # its process is gone: taken over
        assert json.loads(lock.read_text())["token"] == held.token


def test_a_lock_from_another_host_expires_after_its_ttl(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path))
    lock = tmp_path / "_locks" / "samples" / "photos.lock"
    lock.parent.mkdir(parents=True)
    lock.write_text(json.dumps({"token": "t", "run": "dagster run elsewhere", "host": "another-host", "pid": 1,
                                "since": time.time(), "ttl": 60}))
    with pytest.raises(PartitionLocked, match="dagster run elsewhere"):  # fresh: held
        PartitionLock(storage, "samples", "photos").acquire()
    os.utime(lock, (time.time() - 61, time.time() - 61))  # no heartbeat for longer than its ttl
    with partition_lock(storage, "samples", "photos") as held:
        assert json.loads(lock.read_text())["token"] == held.token
    assert not lock.exists()


def test_the_heartbeat_keeps_a_long_run_locked_and_a_lost_lock_fails_the_holder(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path))
    held = PartitionLock(storage, "samples", "photos", ttl=0.6).acquire()
    time.sleep(1.5)  # more than twice the ttl: only the heartbeat keeps it fresh
    with pytest.raises(PartitionLocked):
        PartitionLock(storage, "samples", "photos", ttl=0.6).acquire()
    held.release()
    stolen = PartitionLock(storage, "samples", "photos", ttl=30).acquire()
    Path(stolen.uri).unlink()  # taken from it (as a breaker would after a long stall)
    with pytest.raises(LockLost, match="rerun the partition"):
        stolen.release()


def test_s3_lock_is_a_conditional_put(s3_endpoint: dict) -> None:
    import boto3
    import s3fs

    options = s3_endpoint["storage_options"]
    boto3.client("s3", endpoint_url=s3_endpoint["endpoint"], region_name="us-east-1", aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket="locks-bucket")
    storage = Storage("s3://locks-bucket/corpus", options)
    won, lost = race_for_lock(storage, 6)
    assert len(won) == 1 and len(lost) == 5 and "is being written by" in lost[0]
    won[0].release()
    fs = s3fs.S3FileSystem(**options)
    assert not fs.exists("locks-bucket/corpus/_locks/samples/photos.lock")
    stale = {"token": "t", "run": "a crashed run", "host": "another-host", "pid": 1, "since": 0, "ttl": 0.5}
    fs.pipe_file("locks-bucket/corpus/_locks/samples/photos.lock", json.dumps(stale).encode())
    time.sleep(1.5)  # the object's LastModified (the store's clock, whole seconds) is older than its ttl
    with partition_lock(storage, "samples", "photos", ttl=3) as held:
        first = json.loads(fs.cat_file("locks-bucket/corpus/_locks/samples/photos.lock"))
        assert first["token"] == held.token
        time.sleep(4.5)  # past its ttl: the heartbeat (a PUT conditional on the ETag it last wrote) kept it
        fs.invalidate_cache()
        beat = json.loads(fs.cat_file("locks-bucket/corpus/_locks/samples/photos.lock"))
        assert beat["token"] == held.token and beat["heartbeat"] > first["heartbeat"]
        with pytest.raises(PartitionLocked):
            PartitionLock(storage, "samples", "photos").acquire()


def s3_storage(s3_endpoint: dict, bucket: str) -> Storage:
    import boto3

    boto3.client("s3", endpoint_url=s3_endpoint["endpoint"], region_name="us-east-1").create_bucket(Bucket=bucket)
    return Storage(f"s3://{bucket}/corpus", s3_endpoint["storage_options"])


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_lock_objects_change_only_by_compare_and_swap(tmp_path: Path, s3_endpoint: dict, kind: str) -> None:
    """The primitives under the lock: a create over an existing lock, a swap or a remove of a version
    the store does not hold are refused, and a swap of a deleted lock does not recreate it."""
    storage = Storage(str(tmp_path)) if kind == "local" else s3_storage(s3_endpoint, "cas-bucket")
    store, uri = lock_objects.store_for(storage), storage.uri("_locks", "samples", "photos.lock")
    first = store.create(uri, b'{"token": "a", "beat": 1}')
    assert first and store.create(uri, b'{"token": "b"}') is None
    held = store.read(uri)
    assert held is not None and held.record == {"token": "a", "beat": 1} and held.version == first
    assert 0 <= held.age < 60  # by the store's clock
    second = store.swap(uri, b'{"token": "a", "beat": 2}', first)
    assert second and second != first
    assert store.swap(uri, b'{"token": "a", "beat": 3}', first) is None  # a stale heartbeat's version
    assert not store.remove(uri, first)
    assert store.remove(uri, second) and store.read(uri) is None
    assert store.swap(uri, b'{"token": "a", "beat": 4}', second) is None and store.read(uri) is None


class IgnoresConditions(lock_objects.S3Store):
    """An S3-compatible store that accepts If-None-Match / If-Match and ignores them."""

    def _put(self, uri: str, data: bytes, **condition: str) -> str | None:
        return super()._put(uri, data)

    def remove(self, uri: str, version: str) -> bool:
        self.fs.rm_file(uri)
        return True


def test_a_store_ignoring_conditional_writes_is_refused_unless_best_effort(
        s3_endpoint: dict, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    storage = s3_storage(s3_endpoint, "ignoring-bucket")
    monkeypatch.setattr(lock_objects, "store_for", lambda s: IgnoresConditions(s.filesystem()))
    monkeypatch.delenv(locks.BEST_EFFORT_ENV, raising=False)
    with pytest.raises(locks.LockUnsupported, match=r"ignores conditional writes .* PRX_LOCK_BEST_EFFORT=1"):
        PartitionLock(storage, "samples", "photos").acquire()
    fs = storage.filesystem()
    fs.invalidate_cache()
    assert not fs.exists("ignoring-bucket/corpus/_locks/samples/photos.lock")  # refused before writing a lock
    assert not fs.find("ignoring-bucket/corpus/_locks/.probe")  # the probe cleaned up
    monkeypatch.setenv(locks.BEST_EFFORT_ENV, "1")
    with caplog.at_level("WARNING"), partition_lock(storage, "samples", "photos"):
        pass
    assert "LOCKING IS BEST EFFORT" in caplog.text
    monkeypatch.setattr(lock_objects, "store_for", STORE_FOR)
    with partition_lock(s3_storage(s3_endpoint, "honouring-bucket"), "samples", "photos"):
        pass  # moto honours them: probed, locked, no warning needed




def test_an_object_store_without_conditional_writes_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(locks.BEST_EFFORT_ENV, raising=False)
    with pytest.raises(locks.LockUnsupported, match="memory://corpus ignores conditional writes"):
        PartitionLock(Storage("memory://corpus"), "samples", "photos").acquire()


# -- two real runs of one partition at once ------------------------------------------------------------

def image_folder(folder: Path, count: int = 2) -> SourceSpec:
    import numpy as np

    rng = np.random.default_rng(3)
    folder.mkdir(parents=True)
    for i in range(count):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)).save(buffer, "JPEG", quality=90)
        (folder / f"photo_{i}.jpg").write_bytes(buffer.getvalue())
    return SourceSpec("photos", "imagefolder", str(folder))


@pytest.mark.usefixtures("ray_cluster")
def test_two_runs_of_one_new_partition_commit_once(tmp_path: Path) -> None:
    """Before the lock, both replaces of a new partition committed: 4 rows instead of 2."""
    spec, storage = image_folder(tmp_path / "images"), Storage(str(tmp_path / "corpus"))
    lock = tmp_path / "corpus" / "_locks" / "samples" / "photos.lock"
    outcome: dict[str, Any] = {}
    first = threading.Thread(target=lambda: outcome.update(report=build_samples(spec, storage)))
    first.start()
    deadline = time.monotonic() + 60
    while not lock.exists() and first.is_alive() and time.monotonic() < deadline:
        time.sleep(0.005)
    with pytest.raises(PartitionLocked, match="partition 'photos' of asset 'samples' is being written by"):
        build_samples(spec, storage)  # the second run, while the first one holds the partition
    first.join()
    assert outcome["report"].rows == 2 and not lock.exists()
    assert lance.dataset(storage.lance_uri("samples")).count_rows(filter=source_predicate("photos")) == 2

    results: list[Any] = []
    barrier = threading.Barrier(2)

    def race() -> None:
        barrier.wait()
        try:
            results.append(build_samples(spec, storage))
        except PartitionLocked as exc:
            results.append(exc)

    racers = [threading.Thread(target=race) for _ in range(2)]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join()
    assert any(not isinstance(r, Exception) for r in results)  # one ran; the other was refused or came after
    assert all(not isinstance(r, Exception) or isinstance(r, PartitionLocked) for r in results)
    assert lance.dataset(storage.lance_uri("samples")).count_rows(filter=source_predicate("photos")) == 2
    assert locks.LOCKS in os.listdir(storage.root) and not lock.exists()


def test_a_local_lock_without_hard_links_is_still_exclusive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Some file systems (SMB, some FUSE mounts) refuse `link`: the lock falls back to O_EXCL."""
    import errno

    def no_links(*_: object) -> None:
        raise OSError(errno.EPERM, "hard links not supported")

    monkeypatch.setattr(os, "link", no_links)
    won, lost = race_for_lock(Storage(str(tmp_path)), 4)
    assert (len(won), len(lost)) == (1, 3)
    won[0].release()
    assert not (tmp_path / "_locks" / "samples" / "photos.lock").exists()
