"""Captioner backends: a config, a stable id and version, and one result per image.

The contract every backend keeps is `CaptionerConfig` -> `captioner_id()` / `version()` ->
one `CaptionResult` per input (failures recorded, never raised), so the captions asset keys rows
by captioner version and re-captions only when the output could change. A vLLM backend (a whole
Ray Data stage via `ray.data.llm.build_processor`) or an OpenAI-compatible endpoint reuses the
config, id/version and the `CaptionBatch` output columns; only the engine behind them changes.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from prx_core.models.caption_base import (
    NO_SOURCE_CAPTION,
    OPENAI,
    SOURCE,
    TRANSFORMERS,
    VLLM,
    Captioner,
    CaptionerConfig,
    CaptionResult,
    check_lengths,
    to_bytes,
    to_optional_str,
    word_count,
)
from prx_core.models.caption_text import clean_caption

# Why a sample has no caption under the `source` captioner, and what to do about it: the reject
# message of `mds_shards` (no_caption) and the `captions` run's refusal of a source without any.
NO_CAPTION_HERE = "the source has no caption for this image"
SOURCE_HAS_NONE = ("the source has no caption and the captioner is `source`: configure a VLM captioner "
                   "(README: Captioning)")
VLM_SETTINGS = ("`captioner: {backend: vllm, model: <hub id or checkpoint dir>}`, "
                "`captioner: {backend: openai, endpoint: http://host:8000/v1, model: <served model>}` or "
                "`captioner: {backend: transformers, model: <checkpoint dir>}` in PRX_CONFIG")


class SourceCaptioner(Captioner):
    """Keeps the source dataset's caption: the baseline, and the no-GPU path. Ingest cleaned and
    capped it already; it is cleaned again (a no-op then) for rows ingested before that existed."""

    def caption_batch(self, images: Sequence[bytes], original_captions: Sequence[str | None]) -> list[CaptionResult]:
        check_lengths(images, original_captions)
        if self.config.seconds_per_image:
            time.sleep(self.config.seconds_per_image * len(images))
        cleaned = [clean_caption(text, self.config.max_caption_chars).text for text in original_captions]
        return [
            CaptionResult(text) if text
            else CaptionResult.failed(NO_SOURCE_CAPTION, NO_CAPTION_HERE)
            for text in cleaned
        ]


def no_source_captions_message(source: str, eligible: int) -> str:
    """The `captions` run's refusal of a source none of whose eligible images has a source caption
    under the `source` captioner: nothing of it could ever reach the MDS output."""
    return (f"source {source!r}: none of its {eligible} eligible images has a caption and the captioner is `source` "
            f"(it only keeps source captions): configure a VLM captioner, e.g. {VLM_SETTINGS} (README: Captioning), "
            "or point the catalog entry at the source's captions (caption_column, joins)")


def missing_caption_message(captioner_version: str, error: str | None) -> str:
    """Why a sample has no caption of `captioner_version`, from its stored failure (`error`):
    the message of its `no_caption` reject in `mds_shards`."""
    reason = (error or "").split(":", 1)[0]
    if reason == NO_SOURCE_CAPTION:
        return SOURCE_HAS_NONE
    if error:
        return (f"captioning failed for captioner version {captioner_version} ({error[:200]}); "
                "the next captions run retries it")
    return f"no caption for captioner version {captioner_version}"


def build_captioner(config: CaptionerConfig) -> Captioner:
    if config.backend == SOURCE:
        return SourceCaptioner(config)
    if config.backend == TRANSFORMERS:
        from prx_core.models.captioning_transformers import TransformersCaptioner

        return TransformersCaptioner(config)
    if config.backend == OPENAI:
        from prx_core.models.captioning_openai import OpenAICaptioner

        return OpenAICaptioner(config)
    if config.backend == VLLM:
        raise ValueError(
            "the vllm captioner backend runs as a whole Ray Data stage (prx_core.models.captioning_vllm."
            "build_vllm_processor, used by prx_core.stages.captions.build_captions), not per batch"
        )
    raise ValueError(f"no captioner for backend {config.backend!r}")  # unreachable: config validates


class CaptionBatch:
    """Ray Data `map_batches` callable: one captioner per actor, built in the constructor.

    Input columns: content_id, image (bytes), original_caption (optional). Output: content_id,
    caption ("" on failure), captioner_id, captioner_version, prompt_version, word_count, error
    ("" when ok), num_generated_tokens (0 where unknown). The image bytes are not passed on.
    """

    def __init__(self, config: CaptionerConfig) -> None:
        self.config = config
        self.captioner_id = config.captioner_id()
        self.version = config.version()
        self.captioner = build_captioner(config)

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, np.ndarray]:
        content_ids = [str(value) for value in batch["content_id"]]
        images = [to_bytes(value) for value in batch["image"]]
        originals = batch["original_caption"] if "original_caption" in batch else [None] * len(images)
        results = self.captioner.caption_batch(images, [to_optional_str(value) for value in originals])
        captions = [result.caption or "" for result in results]
        count = len(results)
        return {
            "content_id": np.array(content_ids, dtype=object),
            "caption": np.array(captions, dtype=object),
            "captioner_id": np.array([self.captioner_id] * count, dtype=object),
            "captioner_version": np.array([self.version] * count, dtype=object),
            "prompt_version": np.array([self.config.recorded_prompt_version()] * count, dtype=object),
            "word_count": np.array([word_count(text) for text in captions], dtype=np.int64),
            "error": np.array([result.error or "" for result in results], dtype=object),
            "num_generated_tokens": np.array([result.tokens or 0 for result in results], dtype=np.int64),
        }
