"""A Ray worker process SIGKILLed in the middle of a `samples` unit (its fragments written, its
completion record on the wire): Ray retries the unit within the bounded retries and the
partition holds exactly the rows of a clean run, none twice; a unit whose every attempt dies
fails the run naming the unit."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from s3_proxy import Proxy, client_pid
from test_faults_s3 import s3, storage_for  # noqa: F401  (the fixture)
from test_resume import parquet_source

from prx_core.stages.samples.stage import build_samples
from prx_core.store import lance_io
from prx_core.store.partitions import source_predicate
from prx_core.store.storage import Storage

RECORD = r"/corpus/_runs/samples/photos/[0-9a-f]+/done/u000001\.json"  # the 2nd unit's completion record


def kill_the_sender(killed: list[int]):
    """A proxy hook: SIGKILL the Ray worker sending this request, and drop the request."""
    def hook(proxy: Proxy, method: str, path: str, client) -> bool:
        pid = client_pid(client)
        assert pid != os.getpid() and b"ray" in Path(f"/proc/{pid}/cmdline").read_bytes().lower()
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
        return True
    return hook


def sample_ids(storage: Storage) -> list[str]:
    table = lance_io.read_table(storage.lance_uri("samples"), ["sample_id"], source_predicate("photos"),
                                storage.lance_storage_options())
    return sorted(table["sample_id"].to_pylist())


def test_a_killed_worker_is_retried_and_writes_no_row_twice(s3, tmp_path: Path) -> None:  # noqa: F811
    proxy, _, bucket = s3
    spec = parquet_source(tmp_path / "source", files=3, rows=4)
    storage = storage_for(proxy, bucket)
    killed: list[int] = []
    proxy.watch("PUT", RECORD, kill_the_sender(killed))
    report = build_samples(spec, storage, unit_bytes=1)
    assert len(killed) == 1
    clean = build_samples(spec, Storage(str(tmp_path / "clean")), unit_bytes=1)
    ids = sample_ids(storage)
    assert len(ids) == len(set(ids)) == report.rows == clean.rows == len(sample_ids(Storage(str(tmp_path / "clean"))))
    assert lance_io.partition_digest(storage.lance_uri("samples"), source_predicate("photos"),
                                     storage_options=storage.lance_storage_options()) == \
        lance_io.partition_digest(Storage(str(tmp_path / "clean")).lance_uri("samples"), source_predicate("photos"))


def test_a_unit_whose_every_attempt_dies_is_given_up_after_the_bounded_retries(s3, tmp_path: Path) -> None:  # noqa: F811
    """Three attempts (the first and 2 retries), never more; then the unit's source file becomes an
    `unreadable_fragment` reject and the rest of the source is stored."""
    proxy, _, bucket = s3
    spec = parquet_source(tmp_path / "source", files=2, rows=2)
    storage = storage_for(proxy, bucket)
    killed: list[int] = []
    proxy.watch("PUT", RECORD, kill_the_sender(killed), times=10)
    report = build_samples(spec, storage, unit_bytes=1)
    assert report.rows == 2 and report.rejected == 1 and report.reasons == {"unreadable_fragment": 1}
    assert sample_ids(storage) == ["photos/k0000", "photos/k0001"]
    assert len(killed) == 3
