"""Models and policy: the captioner, the caption labeler and the skip policy.

Each resource turns its fields into a `prx_core` config whose `version()` becomes the
`code_version` of the assets it drives, so changing a model, the prompt or the policy marks
exactly those assets stale in the UI.
"""

from __future__ import annotations

import dagster as dg
from pydantic import Field

from prx_core.captioning import CaptionerConfig
from prx_core.labels import LabelerConfig
from prx_core.prompts import PROMPT_VERSION
from prx_core.stages.skip_lists import SKIP_LABELS, SkipPolicy


class CaptionerResource(dg.ConfigurableResource):
    """Re-captioning backend: `source` copies the source caption (demo default); `transformers`
    runs a local Hugging Face VLM checkpoint in Ray actors."""

    backend: str = Field(default="source", description="source | transformers")
    model: str = Field(default="", description="Local checkpoint directory (transformers backend).")
    prompt_version: str = Field(default=PROMPT_VERSION, description="Version of prx_core.prompts.CAPTION_PROMPT.")
    max_new_tokens: int = Field(default=256, description="Generation budget per caption.")
    temperature: float = Field(default=0.0, description="0 means greedy decoding.")
    top_p: float = Field(default=1.0, description="Nucleus sampling mass when temperature > 0.")
    max_pixels: int = Field(default=448 * 448, description="Pixel cap of the image sent to the model.")
    batch_size: int = Field(default=8, description="Images per model call.")
    actors: int = Field(default=1, description="Ray actors (model replicas) captioning in parallel.")

    def config(self) -> CaptionerConfig:
        return CaptionerConfig(
            backend=self.backend, model=self.model, prompt_version=self.prompt_version,
            max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
            max_pixels=self.max_pixels, batch_size=self.batch_size,
        )


class LabelerResource(dg.ConfigurableResource):
    """Caption labeller (visual / text / nsfw): zero-shot MiniLM on the CPU."""

    backend: str = Field(default="minilm", description="minilm")
    text_threshold: float | None = Field(default=None, description="Override of the text threshold.")
    nsfw_threshold: float | None = Field(default=None, description="Override of the nsfw threshold.")
    actors: int = Field(default=1, description="Ray actors labelling in parallel.")

    def config(self) -> LabelerConfig:
        overrides = {k: v for k, v in (("text_threshold", self.text_threshold), ("nsfw_threshold", self.nsfw_threshold)) if v is not None}
        return LabelerConfig(backend=self.backend, **overrides)


class SkipPolicyResource(dg.ConfigurableResource):
    """What training skips (without rewriting shards)."""

    duplicates: bool = Field(default=True, description="Skip duplicates that lose to their group's keeper.")
    labels: list[str] = Field(default_factory=lambda: list(SKIP_LABELS), description="Caption labels to skip.")
    opt_out: list[str] = Field(default_factory=list, description="source_keys or sample_ids to skip (opt-outs).")

    def policy(self) -> SkipPolicy:
        return SkipPolicy(self.duplicates, tuple(self.labels), tuple(self.opt_out))
