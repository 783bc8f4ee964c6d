"""The optional text-latent encoder: PRX's precomputed text latents, off unless `model` is set."""

from __future__ import annotations

from typing import Any

import dagster as dg
from pydantic import Field

from prx_core.models.text_latents import CLEANINGS, DEFAULT_MAX_TOKENS, TextLatentsConfig


class TextLatentsResource(dg.ConfigurableResource):
    """What `text_latents` computes and `mds_shards` stores as `latent_caption_<preset>` (and
    `attention_mask_caption_<preset>`): the last hidden state of a checkpoint's text backbone over
    each caption, in bfloat16, as PRX's text tower does. Unset `model`: off (the asset encodes
    nothing, mds_shards stores no latents). The checkpoint (by content), preset, max_tokens, masks
    and cleaning enter the code versions of `text_latents` and `mds_shards`; the rest is speed."""

    model: str = Field(default="", description="Local Hugging Face checkpoint directory (a VLM such as "
                                               "Qwen3-VL-8B-Instruct works: only its text backbone runs). Empty: off.")
    preset: str = Field(default="", description="PRX text-tower preset the latents are for, e.g. qwen3vl-8b-256-bf16: "
                                                "it names the MDS columns (the trainer's `text_tower`).")
    max_tokens: int = Field(default=DEFAULT_MAX_TOKENS, description="The preset's prompt_max_tokens.")
    masks: bool = Field(default=True, description="Store attention masks (the trainer's has_mask_text_latents); then "
                                                  "a latent holds only the caption's tokens (PRX pads it from the mask).")
    cleaning: str = Field(default="basic", description=f"Caption cleaning before tokenizing: {' | '.join(CLEANINGS)} "
                                                       "(basic: ftfy, HTML entities, strip, as PRX's text tower).")
    batch_size: int = Field(default=16, description="Captions per model call.")
    actors: int = Field(default=1, description="Ray actors (model replicas) encoding in parallel.")
    gpus: float = Field(default=0.0, description="GPUs per actor (1 on a GPU cluster); 0 runs on CPU.")
    fused: bool = Field(default=False, description="Compute each caption's latent inside `captions`, on the captioner's "
                                                   "own model (one model loaded): needs captioner.backend transformers, "
                                                   "captioner.dtype bfloat16 and the same checkpoint. Not for vllm.")

    @property
    def enabled(self) -> bool:
        return bool(self.model)

    def config(self) -> TextLatentsConfig | None:
        if not self.model:
            return None
        return TextLatentsConfig(model=self.model, preset=self.preset, max_tokens=self.max_tokens, masks=self.masks,
                                 cleaning=self.cleaning, batch_size=self.batch_size)

    def version(self) -> str:
        """`off`, or the encoder's version: part of the code versions it decides."""
        config = self.config()
        return "off" if config is None else config.version()

    def mds_settings(self) -> dict[str, Any] | None:
        """What `mds_shards` needs to store the latents: None when off."""
        config = self.config()
        if config is None:
            return None
        return {"preset": config.preset, "encoder_version": config.version(), "masks": config.masks,
                "max_tokens": config.max_tokens}
