"""`prx-corpus build --stale` (issue 27, items 1 and 3), as an operator runs it: after a full build of
a three-photo source captioned by a real OpenAI-compatible server on loopback, a captioner setting
that enters the captions' code version changes, and `--stale` rebuilds exactly `captions` and what
reads it, saying why for each; then it has nothing to do and says so, without starting Ray. The
builds use no DAGSTER_HOME: the root's own home (`<root>/_state/dagster`) holds their runs, each
tagged with the root, and a command on another root over that home warns in one line.
One full build and one partial one: 160-220 s on this 2-core machine under load (load average 10-15).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from pathlib import Path

import dagster as dg
import pytest
import yaml
from PIL import Image
from test_build import RUN_LINE, run_cli, run_lines

from prx_core.demo.photos import load_skimage_photos
from prx_core.models.caption_base import Captioner, CaptionerConfig, CaptionResult
from prx_core.models.serving import CaptionServer
from prx_core.stages.captions.stage import CAPTIONS
from prx_resources import CaptionerResource

pytestmark = pytest.mark.slow

DOWNSTREAM = ["captions", "caption_labels", "caption_embeddings", "text_latents", "mds_shards", "skip_lists", "explorer"]
CHOICE_LINE = re.compile(r"^  (?P<asset>[a-z_]+) \[(?P<partition>[a-z0-9_]+)\]: (?P<reason>.+)$")


class DigestCaptioner(Captioner):
    """The model behind the loopback server: the same bytes always get the same caption."""

    def caption_batch(self, images: Sequence[bytes], original_captions: Sequence[str | None]) -> list[CaptionResult]:
        return [CaptionResult(f"a photograph of scene {hashlib.sha256(i).hexdigest()[:8]} in soft daylight")
                for i in images]


@pytest.fixture(scope="module")
def server() -> CaptionServer:
    with CaptionServer(DigestCaptioner(CaptionerConfig("source")), "vlm") as running:
        yield running


def write_photos(work: Path) -> Path:
    """`photos`: 3 real photos (an image folder); the catalog beside them."""
    folder = work / "photos"
    folder.mkdir(parents=True)
    colour = [p for p in load_skimage_photos() if p.image.mode == "RGB"][:3]
    for i, (photo, size) in enumerate(zip(colour, [(640, 480), (512, 512), (480, 640)])):
        photo.image.resize(size, Image.Resampling.BICUBIC).save(folder / f"img_{i}.jpg", quality=90)
    catalog = work / "sources.yaml"
    catalog.write_text(f"sources:\n- {{name: photos, format: imagefolder, uri: {folder}}}\n")
    return catalog


def captioner_config(path: Path, server: CaptionServer, max_new_tokens: int) -> tuple[Path, str]:
    """A PRX_CONFIG with the `openai` captioner on the loopback server, and its captioner version."""
    section = {"backend": "openai", "model": "vlm", "endpoint": server.url, "max_new_tokens": max_new_tokens,
               "min_words": 5}  # the stand-in model's captions are one short sentence
    path.write_text(yaml.safe_dump({"captioner": section}))
    return path, CaptionerResource(**section).config().version()


def choices(stdout: str) -> dict[tuple[str, str], str]:
    """What `--stale` said it chose: (asset, partition) -> reason."""
    return {(m["asset"], m["partition"]): m["reason"] for line in stdout.splitlines() if (m := CHOICE_LINE.match(line))}


def build_runs(home: Path) -> list[dg.DagsterRun]:
    instance = dg.DagsterInstance.from_config(str(home))
    try:
        return [r for r in instance.get_runs() if r.tags.get("prx/launched_by") == "prx-corpus build"]
    finally:
        instance.dispose()


def test_stale_rebuilds_exactly_what_a_captioner_change_unsynced(tmp_path: Path, server: CaptionServer) -> None:
    catalog, root = write_photos(tmp_path), tmp_path / "corpus"
    before, old = captioner_config(tmp_path / "before.yaml", server, 64)
    after, new = captioner_config(tmp_path / "after.yaml", server, 32)
    assert old != new

    def build(config: Path, *more: str):
        return run_cli("build", "--sources", str(catalog), "--root", str(root), "--config", str(config), *more)

    full = build(before)
    assert full.returncode == 0, full.explain()
    home = root / "_state" / "dagster"  # no DAGSTER_HOME, no --dagster-home: the root's own
    assert f"dagster home {home}" in full.stdout.splitlines(), full.explain()
    assert (home / "dagster.yaml").exists() and not choices(full.stdout)
    assert len(run_lines(full.stdout)) == 3  # the chain, duplicates, skip_lists and explorer

    idle = build(before, "--stale")  # a full build leaves nothing unsynced
    assert idle.returncode == 0, idle.explain()
    assert "stale: nothing to materialize (Dagster reports every selected asset partition up to date)" in idle.stdout
    assert not any(RUN_LINE.match(line) for line in idle.stdout.splitlines()), idle.explain()

    requests = server.stats.requests
    changed = build(after, "--stale")
    assert changed.returncode == 0, changed.explain()
    chosen = choices(changed.stdout)
    assert f"stale: {len(DOWNSTREAM)} asset partitions to materialize" in changed.stdout, changed.explain()
    assert list(chosen) == [(asset, "photos") for asset in DOWNSTREAM], changed.explain()
    stage = CAPTIONS.code_version  # the asset's code version is the stage's, then the captioner's
    assert chosen[("captions", "photos")] == f"code version {stage}-{old} -> {stage}-{new}"
    for asset in DOWNSTREAM[1:]:  # each carries the captioner version in its own code version
        assert re.fullmatch(rf"code version \S*{old}\S* -> \S*{new}\S*", chosen[(asset, "photos")]), chosen
    assert run_lines(changed.stdout) == [("captions, caption_labels, caption_embeddings, text_latents, mds_shards", "photos",
                                          "ok"),
                                         ("skip_lists, explorer", "photos", "ok")], changed.explain()
    assert server.stats.requests > requests  # the new version was captioned, not reused

    again = build(after, "--stale")
    assert again.returncode == 0 and "stale: nothing to materialize" in again.stdout, again.explain()
    assert not any(RUN_LINE.match(line) for line in again.stdout.splitlines()), again.explain()
    assert again.seconds < changed.seconds

    # every build run names its root; a command on another root over this home says so in one line
    runs = build_runs(home)
    assert len(runs) == 5 and {r.tags.get("prx/root") for r in runs} == {str(root)}
    other = tmp_path / "other"
    warned = run_cli("sources", "sync", "--sources", str(catalog), "--root", str(other), "--dagster-home", str(home))
    assert warned.returncode == 0, warned.explain()
    lines = [line for line in warned.output.splitlines() if line.startswith("warning: ")]
    assert len(lines) == 1, warned.explain()
    assert f"holds runs of corpus root {root}, not only of root {other}" in lines[0], lines[0]
    assert not (other / "_state").exists()  # the home given was used, not the other root's own
