"""What a newcomer meets on a demo build (the explorer's shared `prx-corpus build` of two demo sources,
explorer_corpus in conftest.py; nothing rebuilt here): the trainer quick-start of docs/training.md (and
the README), run as written; the build's output free of the known third-party noise; materializations'
explorer links.
~20-40 s (the quick-start's streaming loader with two workers)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import dagster as dg
import pytest
from starlette.testclient import TestClient

from prx_core.compute.quiet import NOISE
from prx_resources import ExplorerResource

if TYPE_CHECKING:
    from explorer_corpora import ExplorerCorpus

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
TRAINING = REPO / "docs" / "training.md"  # the loader's documentation: the quick-start and the sample's keys
STREAM = r"[a-z0-9_]+/\d+/\d+x\d+"


def training_section() -> str:
    """docs/training.md's "Loading the corpus" section."""
    return TRAINING.read_text().split("\n## Loading the corpus\n", 1)[1].split("\n## ", 1)[0]


def quickstart() -> str:
    """docs/training.md's first python block under "Loading the corpus"."""
    return re.search(r"```python\n(.*?)```", training_section(), re.S)[1]


def test_the_readme_shows_the_quickstart_that_runs() -> None:
    """The README's "Train" step is the same block, character for character, so the one test below runs both."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert quickstart() in blocks


@pytest.mark.slow
def test_the_readme_quickstart_runs_on_a_demo_build(explorer_corpus: ExplorerCorpus, tmp_path: Path) -> None:
    code = quickstart()
    assert '".prx/demo/corpus"' in code  # the path `make demo` builds, relative to the checkout
    checkout = tmp_path / "checkout"  # stands in for the checkout: .prx/demo/corpus is this build
    (checkout / ".prx" / "demo").mkdir(parents=True)
    (checkout / ".prx" / "demo" / "corpus").symlink_to(explorer_corpus.root)
    (checkout / "quickstart.py").write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    done = subprocess.run([sys.executable, "quickstart.py"], cwd=checkout, capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]
    length, seen = map(int, re.fullmatch(r"len\(dataset\) (\d+), one epoch yielded (\d+)\n", done.stdout).groups())
    # an epoch is full batches of 4, never more than len(); docs/training.md explains the difference
    assert 0 < seen <= length and seen % 4 == 0, done.stdout
    # every warning of ours names streams as <source>/<tier>/<w>x<h>; streaming's "stream with index N" is gone
    assert "stream with index" not in done.stderr.lower(), done.stderr[-5000:]
    if seen < length:
        dropped = re.search(r"drops the incomplete last batch \(batch_size 4\) of (\d+) streams, so it yields fewer "
                            rf"samples than len\(\): ({STREAM}(?:, {STREAM})*)", done.stderr)
        assert dropped, done.stderr[-5000:]
    left_out = re.search(r"CorpusDataset: (\d+) of (\d+) streams of tier 1024 left out", done.stderr)
    if left_out:
        assert re.search(rf"{STREAM} left out: ", done.stderr), done.stderr[-5000:]


def test_the_sample_keys_are_those_the_docs_document() -> None:
    from prx_core.shards.mds.streams import MDS_COLUMNS

    section = training_section()
    documented = {key for row in re.findall(r"^\| (`.+?`) \|", section, re.M) for key in re.findall(r"`(\w+)`", row)}
    assert documented == set(MDS_COLUMNS)


def test_the_build_printed_none_of_the_known_third_party_noise(explorer_corpus: ExplorerCorpus) -> None:
    """Ray's token notice, Lance's fork-safety warning, the GCS's benign kill-actor line
    (prx_core.compute.quiet): none of them in what `prx-corpus build` printed."""
    output = explorer_corpus.build_output
    assert "runs in" in output, output[-3000:]  # the build's last line: the whole output is here
    assert [line for line in output.splitlines() if any(noise in line for noise in NOISE)] == []


def test_materializations_link_to_the_explorer_on_their_source(explorer_corpus: ExplorerCorpus,
                                                               client: TestClient) -> None:
    """`explorer.base_url` (demo-config.yaml: `make browse`'s address) gives materializations a URL
    entry (`samples` and `captions` today), and that URL opens the explorer on the source alone."""
    assert ExplorerResource().metadata("stock_photos") == {}
    link = ExplorerResource(base_url="http://127.0.0.1:8080/").metadata("stock_photos")["explorer"]
    assert isinstance(link, dg.UrlMetadataValue) and link.url == "http://127.0.0.1:8080/?source=stock_photos"
    page = client.get(link.url.removeprefix("http://127.0.0.1:8080"))
    assert page.status_code == 200
    found = client.get("/api/search", params={"source": "stock_photos"}).json()
    assert found["total"] > 0 and {row["source"] for row in found["rows"]} == {"stock_photos"}
    # a filtered link (what skip_lists or rejects would carry), and the corpus-wide one (duplicates)
    skipped = ExplorerResource(base_url="http://127.0.0.1:8080").metadata("stock_photos", skipped="yes")["explorer"]
    assert skipped.url == "http://127.0.0.1:8080/?source=stock_photos&skipped=yes"
    query = skipped.url.split("?", 1)[1]
    rows = client.get(f"/api/search?{query}").json()["rows"]
    assert rows and all(r["source"] == "stock_photos" and r["skip_reason"] for r in rows)
    assert ExplorerResource(base_url="http://127.0.0.1:8080").metadata(None)["explorer"].url == "http://127.0.0.1:8080/"
