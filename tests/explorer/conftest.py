"""One corpus built by the real pipeline (`prx-corpus build`, two demo sources) for every
explorer test, and an app over it. Two sources keep the build short while still holding
cross-source duplicate groups, every reject reason of the buckets stage and the hostile caption.
The corpora themselves and their writers are `explorer_corpora`'s; this file holds the fixtures."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from explorer_corpora import CLI, EXPLORER_SOURCES, ExplorerCorpus, sample_id_of, write_small_corpus
from starlette.testclient import TestClient

from prx_core.store.storage import Storage
from prx_explorer.app import create_app


@pytest.fixture(scope="session")
def explorer_corpus(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> ExplorerCorpus:
    work = tmp_path_factory.mktemp("explorer")
    env = {k: v for k, v in os.environ.items()  # RAY_AUTH_MODE, LANCE_LOG: the build must quiet itself
           if k not in ("DAGSTER_HOME", "PRX_ROOT", "PRX_SOURCES", "PRX_CONFIG", "RAY_AUTH_MODE", "LANCE_LOG")}
    args = [CLI, "build", "--sources", str(demo_dir / "sources.yaml"), "--root", str(work / "corpus"),
            "--dagster-home", str(work / "dh")] + [a for s in EXPLORER_SOURCES for a in ("--source", s)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]
    manifest = [e for e in json.loads((demo_dir / "manifest.json").read_text()) if e["source"] in EXPLORER_SOURCES]
    for entry in manifest:
        entry["sample_id"] = sample_id_of(demo_dir, entry)
    return ExplorerCorpus(work / "corpus", demo_dir, manifest, done.stdout + done.stderr)


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory: pytest.TempPathFactory) -> Storage:
    return write_small_corpus(tmp_path_factory.mktemp("small") / "corpus")


@pytest.fixture(scope="session")
def client(explorer_corpus: ExplorerCorpus) -> TestClient:
    return TestClient(create_app(Storage(str(explorer_corpus.root))), base_url="http://localhost")  # an allowed Host
