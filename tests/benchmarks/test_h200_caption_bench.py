"""The H200 captioning script runs on a CPU with a tiny config of the same family, through the
pipeline's own captioner and text-latent encoder, and its 8B config is the published architecture."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.h200_caption import LATENT_TOKENS, count_parameters, main


def test_the_8b_config_is_qwen3_vl_8b_instruct() -> None:
    assert round(count_parameters() / 1e9, 2) == 8.77  # the model card's parameter count


def test_the_script_runs_tiny_on_cpu_with_a_forced_caption_length(tmp_path: Path) -> None:
    out = tmp_path / "h200.json"
    report = main(["--tiny", "--batch-sizes", "2,4", "--images", "4", "--new-tokens", "6", "--latent-batches", "3",
                   "--latent-rounds", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["device"] == "cpu" and report["parameters"] < 10_000_000
    for row in report["captions"]:
        assert row["failed"] == 0 and row["tokens"] == row["images"] * 6  # every caption exactly 6 tokens
        assert row["images_per_s"] > 0 and row["tokens_per_s"] > row["images_per_s"]
    [latents] = report["latents"]
    assert latents["shape"] == [3, LATENT_TOKENS, 64] and latents["dtype"] == "torch.bfloat16"
    assert 100 < latents["mean_tokens"] <= LATENT_TOKENS and latents["latents"] == 6
