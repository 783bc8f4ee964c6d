"""benchmarks/gpu_caption.py on vLLM's CPU engine (the vLLM test environment): the script and the
Ray Data pipeline it measures run end to end, with the engine's own accounting in the report. A
smoke test: its numbers say nothing of a GPU (docs/benchmarks.md has the GPU command)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.gpu_caption import main
from prx_core.models.vllm_cpu import vllm_python

pytestmark = pytest.mark.slow

IMAGES, TOKENS, SLOTS = 8, 8, 8


def test_gpu_caption_runs_on_the_cpu_engine(tmp_path: Path) -> None:
    assert vllm_python() is not None, "no vLLM test environment: make test installs it (bash scripts/setup-vllm.sh)"
    out = tmp_path / "gpu_caption.json"
    report = main(["--cpu", "--images", str(IMAGES), "--batch-size", "4", "--max-new-tokens", str(TOKENS),
                   "--max-model-len", "2048", "--engine-kwargs", json.dumps({"max_num_seqs": SLOTS}),
                   "--output", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["device"] == "cpu" and report["images"] == IMAGES and report["failed"] == 0, report
    assert report["finish_reasons"] == {"length": IMAGES}  # gibberish runs to the cap, and the report says so
    assert report["tokens_per_s"] == round(IMAGES * TOKENS / report["seconds"], 1)  # every caption TOKENS long
    assert report["startup_seconds"] > 0 and report["generate_seconds"] >= report["startup_seconds"]
    assert report["prepare_seconds"] > 0 and report["engine_seconds_per_request"] > 0
    assert report["mean_input_tokens"] > 100  # the prompt and the image's tokens
    assert report["mean_requests_in_flight"] > 0 and 0 < report["engine_occupancy"] <= 1
