"""Test isolation: HOME and TMPDIR point into one throw-away folder before anything imports
Ray, torch, mosaicml-streaming or dagster (they all write caches and sockets there)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

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
os.environ.pop("DAGSTER_HOME", None)
os.environ.pop("PRX_ROOT", None)
tempfile.tempdir = None  # re-read TMPDIR

ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(_SANDBOX, ignore_errors=True)


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
