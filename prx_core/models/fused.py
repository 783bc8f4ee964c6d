"""Captioning and text latents in one pass over one loaded model (`text_latents.fused`).

When the captioner is the `transformers` backend on the same checkpoint as the text-latent
encoder, loaded in bfloat16 (the dtype PRX's text tower computes latents in), a captioner actor
encodes each caption it generates with the same model's text backbone: one model in memory, the
captions' text already at hand. What it yields is what `text_latents` would compute in a pass of
its own, bit for bit; that stage then finds them stored and encodes only what the captioner did not
make (contents captioned before, failures retried). vLLM cannot fuse: its generate API returns
tokens, not hidden states.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from prx_core.models.caption_base import TRANSFORMERS, CaptionerConfig, fingerprint_checkpoint
from prx_core.models.captioning import CaptionBatch
from prx_core.models.text_latents import TextLatentsConfig, clean_caption, encode_captions, latent_rows, text_backbone


def check_fusable(captioner: CaptionerConfig, latents: TextLatentsConfig) -> None:
    """Refuse a fused setting that cannot share one model, naming what to change."""
    if captioner.backend != TRANSFORMERS:
        raise ValueError(f"text_latents.fused needs captioner.backend: transformers, not {captioner.backend!r} (vLLM's "
                         "generation returns no hidden states): drop `fused` to encode in a pass of its own")
    if captioner.dtype != "bfloat16":
        raise ValueError("text_latents.fused needs captioner.dtype: bfloat16 (text latents are computed in bfloat16)")
    if fingerprint_checkpoint(Path(captioner.model)) != fingerprint_checkpoint(Path(latents.model)):
        raise ValueError(f"text_latents.fused needs the captioner's checkpoint: captioner.model {captioner.model!r} "
                         f"and text_latents.model {latents.model!r} differ")


class FusedCaptionBatch(CaptionBatch):
    """`CaptionBatch` plus, for every caption generated without error, its latent: the output gains
    `latent` (bytes, None for a failure), `tokens`, `hidden`, `encoder_id`, `encoder_version`."""

    def __init__(self, config: CaptionerConfig, latents: TextLatentsConfig) -> None:
        check_fusable(config, latents)
        super().__init__(config)
        self.latents = latents
        self.encoder_id, self.encoder_version = latents.encoder_id(), latents.version()
        self.model = self.captioner.model
        self.tokenizer = self.captioner.processor.tokenizer  # padding side is given per encode call
        self.hidden = int(text_backbone(self.model).config.hidden_size)

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, np.ndarray]:
        out = super().__call__(batch)
        ok = [i for i, error in enumerate(out["error"]) if not error]
        latents: list[bytes | None] = [None] * len(out["content_id"])
        tokens = np.zeros(len(latents), np.int32)
        for start in range(0, len(ok), self.latents.batch_size):
            rows = ok[start:start + self.latents.batch_size]
            texts = [clean_caption(out["caption"][i], self.latents.cleaning) for i in rows]
            encoded, mask = encode_captions(self.model, self.tokenizer, texts, self.latents.max_tokens)
            for i, (data, count) in zip(rows, latent_rows(encoded, mask, self.latents.masks)):
                latents[i], tokens[i] = data, count
        n = len(latents)
        return {**out, "latent": np.array(latents, dtype=object), "tokens": tokens,
                "hidden": np.full(n, self.hidden, np.int32), "encoder_id": np.full(n, self.encoder_id, dtype=object),
                "encoder_version": np.full(n, self.encoder_version, dtype=object)}
