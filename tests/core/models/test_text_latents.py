"""Text latents as PRX's text tower computes them, checked against the same model run directly."""

from __future__ import annotations

import pytest
import torch

from prx_core.models.text_latents import encode_captions, text_backbone
from prx_core.models.tiny_vlm import build_tiny_qwen2_vl

CAPTIONS = ["a red chair on the left of a wooden table", "text", "a dog " * 200]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = build_tiny_qwen2_vl(tmp_path_factory.mktemp("vlm") / "tiny")
    model = AutoModelForImageTextToText.from_pretrained(path, local_files_only=True, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(path, local_files_only=True).tokenizer


@pytest.mark.parametrize("max_tokens", [8, 32])
def test_latents_are_the_last_hidden_state_of_the_text_model(tiny, max_tokens: int) -> None:
    model, tokenizer = tiny
    latents, mask = encode_captions(model, tokenizer, CAPTIONS, max_tokens)
    assert latents.shape == (3, max_tokens, model.config.text_config.hidden_size) and latents.dtype == torch.bfloat16
    lengths = [len(tokenizer(c)["input_ids"]) for c in CAPTIONS]
    assert mask.sum(dim=1).tolist() == [min(n, max_tokens) for n in lengths]  # right-padded, truncated
    assert all(bool(row[:n].all()) and not bool(row[n:].any()) for row, n in zip(mask, mask.sum(dim=1).tolist()))
    batch = tokenizer(CAPTIONS, padding="max_length", truncation=True, max_length=max_tokens, return_tensors="pt",
                      padding_side="right")
    positions = torch.arange(max_tokens).expand(3, len(CAPTIONS), max_tokens)  # a text encoder's: 0..T-1
    with torch.inference_mode():  # the whole VLM, text only, through its own forward
        direct = model(**batch, position_ids=positions, output_hidden_states=True).hidden_states[-1]
    assert torch.equal(latents, direct.to(torch.bfloat16))
    assert type(text_backbone(model)).__name__ == "Qwen2VLTextModel"  # the vision tower is not run
