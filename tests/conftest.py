"""Test isolation: HOME and TMPDIR point into one throw-away folder before anything imports
Ray, torch, mosaicml-streaming or dagster (they all write caches and sockets there)."""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import sys
import tarfile
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest

# Short base path: Ray's unix sockets must stay under 107 characters.
_SANDBOX = Path(tempfile.mkdtemp(prefix="prxt-", dir="/tmp"))
for _sub in ("home", "tmp"):
    (_SANDBOX / _sub).mkdir()
os.environ["HOME"] = str(_SANDBOX / "home")
os.environ["TMPDIR"] = str(_SANDBOX / "tmp")
os.environ["XDG_CACHE_HOME"] = str(_SANDBOX / "home" / ".cache")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
# albumentations (imported by img2dataset) asks PyPI for a newer version at import unless told not to: the
# tests reach nothing but 127.0.0.1. Set before img2dataset's spawned processes inherit the environment.
os.environ["NO_ALBUMENTATIONS_UPDATE"] = "1"
os.environ.pop("DAGSTER_HOME", None)
os.environ.pop("PRX_ROOT", None)
# S3 credentials of the loopback endpoint come from the environment, as in production (storage
# options never hold secrets); set before any Ray starts, so every Ray worker inherits them.
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
tempfile.tempdir = None  # re-read TMPDIR

# scripts/test.sh runs its halves in the background, where SIGINT arrives ignored; the in-process builds'
# compute-log tails would then ignore SIGTERM and cost 30 s each to clean up (prx_core.compute.interrupts explains)
from prx_core.compute.interrupts import restore_interrupt_signals  # noqa: E402

restore_interrupt_signals()

ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(_SANDBOX, ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _release_streaming_shared_memory() -> Iterator[None]:
    """Close the shared memory of the StreamingDatasets a test module made.

    mosaicml-streaming registers each segment's cleanup with `atexit`, so a dataset's ~36 file
    descriptors stay open until the process exits, however dead the dataset: one pytest reading
    a few hundred streams ran out of descriptors (CI's limit is 1,024). The trainer makes one
    dataset per process; only a test suite makes hundreds."""
    yield
    memory = sys.modules.get("streaming.base.shared.memory")
    if memory is None:
        return
    with warnings.catch_warnings():  # isinstance() on torch's deprecated `reduce_op` object warns
        warnings.simplefilter("ignore", FutureWarning)
        segments = [o for o in gc.get_objects() if isinstance(o, memory.SharedMemory)]
    for shm in segments:
        atexit.unregister(shm.cleanup)
        shm.cleanup()
        shm.created_shms, shm.opened_shms = [], []


@pytest.fixture(scope="session")
def sandbox() -> Path:
    return _SANDBOX


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo sources, built once per session (wallpapers included where installed)."""
    from prx_core.demo import build_demo_sources

    out = tmp_path_factory.mktemp("demo") / "sources"
    build_demo_sources(out)
    return out


@pytest.fixture(scope="session")
def demo_files(demo_dir: Path) -> dict[tuple[str, str], tuple[bytes, str]]:
    return read_sources(demo_dir)


def read_sources(demo: Path) -> dict[tuple[str, str], tuple[bytes, str]]:
    """(source, key) -> (image bytes, caption) for every sample of every demo source.

    Read with plain pyarrow / tarfile / os, not the pipeline's readers, so a bug in the
    writer cannot hide behind the same bug in a reader."""
    from prx_core.sources.catalog import load_catalog

    catalog = load_catalog(demo / "sources.yaml")
    out: dict[tuple[str, str], tuple[bytes, str]] = {}
    for spec in catalog.sources:
        root = Path(spec.uri)
        if spec.format == "parquet":
            for part in sorted(root.glob("*.parquet")):
                for row in pq.read_table(part).to_pylist():
                    out[(spec.name, row[spec.key_column])] = (row[spec.image_column], row[spec.caption_column])
        elif spec.format == "huggingface":  # the Hub layout: data/*.parquet with an Image() struct column
            for part in sorted(root.glob("data/*.parquet")):
                for row in pq.read_table(part).to_pylist():
                    out[(spec.name, row[spec.key_column])] = (row["image"]["bytes"], row["text"])
        elif spec.format == "imagefolder":
            for path in sorted(root.rglob("*")):
                if path.is_file() and path.suffix != ".txt":
                    out[(spec.name, path.stem)] = (path.read_bytes(), path.with_suffix(".txt").read_text().strip())
        elif spec.format == "webdataset":
            members: dict[str, dict[str, bytes]] = {}
            for shard in sorted(root.glob("*.tar")):
                with tarfile.open(shard) as tar:
                    for m in tar.getmembers():
                        key, ext = m.name.split(".", 1)
                        members.setdefault(key, {})[ext] = tar.extractfile(m).read()
            for key, files in members.items():
                image = next(v for k, v in files.items() if k != "txt")
                out[(spec.name, key)] = (image, files["txt"].decode().strip())
    return out


@pytest.fixture(scope="session")
def s3_endpoint() -> dict:
    """A real S3 HTTP endpoint on loopback (moto's server) and s3fs storage options for it."""
    import socket

    from moto.server import ThreadedMotoServer

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    options = {"client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}  # credentials: env
    yield {"endpoint": endpoint, "storage_options": options}
    server.stop()
