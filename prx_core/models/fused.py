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
from prx_core.models.caption_checks import REJECTED
from prx_core.models.captioning import CaptionBatch
from prx_core.models.text_latents import TextLatentsConfig, encode_texts, latent_outputs, text_backbone


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
        """`check_fusable` has passed: the captions stage checks it when it pins its attempt."""
        super().__init__(config)
        self.latents = latents
        self.encoder_version = latents.version()
        self.encoder_id = latents.encoder_id(self.encoder_version)
        self.model = self.captioner.model
        self.tokenizer = self.captioner.processor.tokenizer  # padding side is given per encode call
        self.hidden = int(text_backbone(self.model).config.hidden_size)

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, np.ndarray]:
        out = super().__call__(batch)  # a rejected caption is never shipped: no latent for it
        ok = [i for i, (error, verdict) in enumerate(zip(out["error"], out["verdict"])) if not error and verdict != REJECTED]
        encoded: list[tuple[bytes, int] | None] = [None] * len(out["content_id"])
        for i, row in zip(ok, encode_texts(self.model, self.tokenizer, self.latents, [out["caption"][i] for i in ok])):
            encoded[i] = row
        return {**out, **latent_outputs(encoded, self.hidden, self.encoder_id, self.encoder_version)}
