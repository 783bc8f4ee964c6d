"""The corpus root's disk full, on a real size-limited filesystem (a tmpfs mounted for the test):
`samples`, `mds_shards` and `skip_lists` fail with an error naming the path they could not
write, the previous version of the table, streams and skip-lists reads back unchanged, and once
space is freed a rerun completes."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_mds_stage import CAPTIONER, add_captions
from test_resume import parquet_source
from test_row_stages import SIZES
from test_stage_functions import jpeg

from prx_core.shards.mds.read import read_stream_rows
from prx_core.shards.mds.streams import list_streams
from prx_core.stages.mds_shards.stage import build_mds
from prx_core.stages.samples.stage import build_samples
from prx_core.stages.skip_lists.stage import SkipPolicy, build_skip_lists
from prx_core.store import lance_io
from prx_core.store.partitions import source_predicate
from prx_core.store.storage import Storage

pytestmark = pytest.mark.usefixtures("ray_cluster")
POLICY = SkipPolicy(opt_out=("k0000", "k0001", "k0104"))


class SmallDisk:
    """A tmpfs of `megabytes` mounted at `path`; `fill()` takes all its free space, `free()` gives
    it back."""

    def __init__(self, path: Path, megabytes: int) -> None:
        self.path, self.filler = path, path / ".filler"
        path.mkdir(parents=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(path)], check=True,
                       capture_output=True, text=True)

    def fill(self) -> None:
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            for block in (1 << 20, 1 << 12, 1):
                try:
                    while True:
                        os.write(fd, b"\0" * block)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC
        finally:
            os.close(fd)
        assert shutil.disk_usage(self.path).free < 4096

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], check=False, capture_output=True)


@pytest.fixture()
def disk(tmp_path: Path) -> Iterator[SmallDisk]:
    small = SmallDisk(tmp_path / "disk", 48)
    yield small
    small.unmount()


def tree(base: Path) -> dict[str, str]:
    return {p.relative_to(base).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(base.rglob("*")) if p.is_file()}


def published(storage: Storage) -> dict[str, list[tuple[str, str]]]:
    """Every published stream of `photos`, read back: (sample_id, caption) in order."""
    return {uri[len(storage.root):]: [(r["sample_id"], r["caption"]) for r in read_stream_rows(uri, ["sample_id", "caption"])]
            for uri in list_streams(storage.root, "photos")}


def build(spec, storage: Storage, policy: SkipPolicy) -> None:
    build_samples(spec, storage, unit_bytes=1)
    add_captions(storage, skip=0, text="another picture")
    build_mds("photos", storage, CAPTIONER, route_rows=7, chunk_rows=3)
    build_skip_lists("photos", storage, CAPTIONER, "lab-v1", policy)


def state(storage: Storage) -> tuple[str, dict, dict]:
    """The partition's samples rows, its streams read back and its skip-list files."""
    return (lance_io.partition_digest(storage.lance_uri("samples"), source_predicate("photos")), published(storage),
            tree(Path(storage.root, "skiplists")))


def assert_full_disk(error: BaseException, root: str) -> None:
    """The run failed because the disk is full, and says where."""
    text = str(error)
    assert "no space left on the device while writing" in text.lower() and root in text, text


def test_a_full_disk_fails_naming_the_path_and_keeps_the_previous_version(disk: SmallDisk, tmp_path: Path) -> None:
    spec = parquet_source(tmp_path / "source", files=3, rows=4)
    storage = Storage(str(disk.path / "corpus"))
    build_samples(spec, storage, unit_bytes=1)
    add_captions(storage, skip=0)
    build_mds("photos", storage, CAPTIONER, route_rows=7, chunk_rows=3)
    build_skip_lists("photos", storage, CAPTIONER, "lab-v1", POLICY)
    before = state(storage)
    assert before[1] and before[2]

    items = [{"key": f"k09{i:02d}", "image": jpeg(*SIZES[i % len(SIZES)], seed=900 + i), "caption": f"new {i}"}
             for i in range(4)]
    pq.write_table(pa.Table.from_pylist(items), Path(spec.uri, "part-00009.parquet"))
    disk.fill()
    with pytest.raises(OSError) as failed:
        build_samples(spec, storage, unit_bytes=1)
    assert_full_disk(failed.value, storage.root)
    assert state(storage) == before

    disk.free()
    add_captions(storage, skip=0, text="another picture")
    disk.fill()
    with pytest.raises(OSError) as failed:
        build_mds("photos", storage, CAPTIONER, route_rows=7, chunk_rows=3)
    assert_full_disk(failed.value, storage.root)
    with pytest.raises(OSError) as failed:
        build_skip_lists("photos", storage, CAPTIONER, "lab-v1", SkipPolicy(opt_out=("k0002",)))
    assert_full_disk(failed.value, storage.root)
    assert state(storage) == before

    disk.free()  # space back: the reruns complete and equal a clean build of the same inputs
    policy = SkipPolicy(opt_out=("k0001", "k0901"))
    build(spec, storage, policy)
    clean = Storage(str(tmp_path / "clean"))
    build(spec, clean, policy)
    after = state(storage)
    assert after == state(clean) and after != before
