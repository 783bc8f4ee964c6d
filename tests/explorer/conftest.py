"""One corpus built by the real pipeline (`prx-corpus build`, two demo sources) for every
explorer test, and an app over it. Two sources keep the build short while still holding
cross-source duplicate groups, every reject reason of the buckets stage and the hostile caption."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from prx_core.store.storage import Storage
from prx_explorer.app import create_app

CLI = str(Path(sys.executable).with_name("prx-corpus"))
EXPLORER_SOURCES = ("stock_photos", "web_images")


@dataclass(frozen=True)
class ExplorerCorpus:
    root: Path
    demo: Path
    manifest: list[dict[str, Any]]  # planted entries of the built sources, with `sample_id`

    def planted(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.manifest if kind in e["kinds"]]


def sample_id_of(demo: Path, entry: dict[str, Any]) -> str:
    """`<source>/<source_key>`; image-folder keys are paths relative to the folder, no extension."""
    key = entry["key"]
    if entry["source"] == "web_images":
        [path] = [p for p in (demo / "web_images").rglob(f"{key}.*") if p.suffix != ".txt"]
        key = path.relative_to(demo / "web_images").with_suffix("").as_posix()
    return f"{entry['source']}/{key}"


@pytest.fixture(scope="session")
def explorer_corpus(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> ExplorerCorpus:
    work = tmp_path_factory.mktemp("explorer")
    env = {k: v for k, v in os.environ.items() if k not in ("DAGSTER_HOME", "PRX_ROOT", "PRX_SOURCES", "PRX_CONFIG")}
    args = [CLI, "build", "--sources", str(demo_dir / "sources.yaml"), "--root", str(work / "corpus"),
            "--dagster-home", str(work / "dh")] + [a for s in EXPLORER_SOURCES for a in ("--source", s)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]
    manifest = [e for e in json.loads((demo_dir / "manifest.json").read_text()) if e["source"] in EXPLORER_SOURCES]
    for entry in manifest:
        entry["sample_id"] = sample_id_of(demo_dir, entry)
    return ExplorerCorpus(work / "corpus", demo_dir, manifest)


@pytest.fixture(scope="session")
def client(explorer_corpus: ExplorerCorpus) -> TestClient:
    return TestClient(create_app(Storage(str(explorer_corpus.root))), base_url="http://localhost")  # an allowed Host
