"""Text latents as PRX's text tower computes them: the caption tokenized to `max_tokens` (padded,
truncated, with an attention mask), through the text backbone of a Hugging Face checkpoint, its
last hidden state kept in bfloat16.

Any checkpoint with a language model works; for a VLM (Qwen-VL family) the vision tower is never
run, so the captioner's own checkpoint serves (PRX's `qwen3vl-8b-256-bf16` preset). Imported
only where latents are computed: it loads torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

DEFAULT_MAX_TOKENS = 256  # PRX's prompt_max_tokens


def text_backbone(model: Any) -> Any:
    """The decoder stack whose last hidden state is the latent (no LM head, no vision tower)."""
    for owner in (model, getattr(model, "model", None)):
        backbone = getattr(owner, "language_model", None)
        if backbone is not None and not callable(getattr(backbone, "generate", None)):
            return backbone
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "embed_tokens"):
        return inner
    raise ValueError(f"{type(model).__name__}: no text backbone found (expected `language_model` or `model`)")


def encode_captions(model: Any, tokenizer: Any, captions: Sequence[str],
                    max_tokens: int = DEFAULT_MAX_TOKENS) -> tuple[Any, Any]:
    """(latents [B, max_tokens, hidden] bfloat16, attention mask [B, max_tokens] bool) for `captions`.

    Right-padded to exactly `max_tokens`, so every sample stores the same shape; the mask marks
    the caption's tokens (PRX stores it as `attention_mask_caption_<preset>`)."""
    import torch

    batch = tokenizer(list(captions), padding="max_length", truncation=True, max_length=max_tokens,
                      return_tensors="pt", padding_side="right")
    backbone = text_backbone(model)
    device = next(backbone.parameters()).device
    with torch.inference_mode():
        out = backbone(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device))
    return out.last_hidden_state.to(torch.bfloat16), batch["attention_mask"].to(device).bool()
