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
from dataclasses import dataclass
from typing import Any

import numpy as np

from prx_core.models.caption_base import (
    EMPTY_CAPTION,
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
from prx_core.models.caption_checks import (
    EMPTY,
    FLAGGED,
    OK,
    REJECTED,
    RETRIED,
    UNCHECKED,
    Verdict,
    check_generated,
    check_source,
)
from prx_core.models.caption_text import clean_caption

# Why a sample has no caption under the `source` captioner, and what to do about it: the reject
# message of `mds_shards` (no_caption) and the `captions` run's refusal of a source without any.
NO_CAPTION_HERE = "the source has no caption for this image"
SOURCE_HAS_NONE = ("the source has no caption and the captioner is `source`: configure a VLM captioner "
                   "(docs/captioning.md)")
VLM_SETTINGS = ("`captioner: {backend: vllm, model: <hub id or checkpoint dir>}`, "
                "`captioner: {backend: openai, endpoint: http://host:8000/v1, model: <served model>}` or "
                "`captioner: {backend: transformers, model: <checkpoint dir>}` in PRX_CONFIG")


class SourceCaptioner(Captioner):
    """Keeps the source dataset's caption: the baseline, and the no-GPU path. Ingest cleaned and
    capped it already; it is cleaned again (a no-op then) for rows ingested before that existed."""

    def caption_batch(self, images: Sequence[bytes], original_captions: Sequence[str | None],
                      fallback: bool = False) -> list[CaptionResult]:
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
            f"(it only keeps source captions): configure a VLM captioner, e.g. {VLM_SETTINGS} (docs/captioning.md), "
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


def rejected_caption_message(captioner_version: str, problem: str) -> str:
    """The message of a `caption_rejected` reject in `mds_shards`: the caption checks refused the
    captioner's answer and its retry (prx_core.models.caption_checks)."""
    return (f"the caption of captioner version {captioner_version} failed the caption checks twice ({problem}), "
            "also with the fallback decoding: stored as rejected, never shipped; a new captioner version or "
            "fallback setting captions it again (the explorer's caption filter lists them)")


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
            "build_vllm_processor, used by prx_core.stages.captions.stage.build_captions), not per batch"
        )
    raise ValueError(f"no captioner for backend {config.backend!r}")  # unreachable: config validates


@dataclass(frozen=True)
class Checked:
    """A caption with its quality verdict: `verdict` "" for a failure (its `result.error` is stored
    and retried on the next run), else one of caption_checks.VERDICTS; `problem` the check that
    refused (or flagged) it; `attempts` the generations made; `tokens` generated over all of them."""

    result: CaptionResult
    verdict: str = ""
    problem: str = ""
    attempts: int = 1
    tokens: int = 0


def judge(result: CaptionResult, config: CaptionerConfig) -> Verdict | None:
    """A generated result's verdict; None for a failure that is no caption at all (a bad image,
    an engine error: stored as a failure, not judged). An empty answer is the `empty` problem."""
    if result.error is not None:
        return Verdict(EMPTY, result.error) if result.reason == EMPTY_CAPTION else None
    return check_generated(result.caption, result.finish_reason, min_words=config.min_words, max_words=config.max_words)


def judged(result: CaptionResult, config: CaptionerConfig, attempts: int = 1, tokens: int = 0) -> Checked:
    """One generation's result with its verdict, without a retry (the vLLM pipeline's answers, a retry's answer)."""
    if not config.check_captions:
        return Checked(result, "" if result.error else UNCHECKED, attempts=attempts, tokens=tokens)
    verdict = judge(result, config)
    if verdict is None:
        return Checked(result, attempts=attempts, tokens=tokens)
    if verdict.ok:
        return Checked(result, OK if attempts == 1 else RETRIED, attempts=attempts, tokens=tokens)
    return Checked(CaptionResult(result.caption or "", finish_reason=result.finish_reason), REJECTED,
                   verdict.problem, attempts, tokens)


def checked_captions(captioner: Captioner, images: Sequence[bytes], originals: Sequence[str | None]) -> list[Checked]:
    """Caption, check, and generate once more with the fallback decoding what the checks refused;
    a second refusal is `rejected` (stored, never shipped). Source captions are only flagged."""
    config = captioner.config
    results = captioner.caption_batch(images, originals)
    if config.backend == SOURCE:
        return [Checked(r, FLAGGED if (v := check_source(r.caption, max_words=config.max_words)).problem else OK,
                        v.problem, 0) if r.error is None else Checked(r, attempts=0) for r in results]
    first = [judged(r, config, tokens=r.tokens or 0) for r in results]
    redo = [i for i, c in enumerate(first) if c.verdict == REJECTED]
    again = captioner.caption_batch([images[i] for i in redo], [originals[i] for i in redo], fallback=True) if redo else []
    for i, result in zip(redo, again):
        retry = judged(result, config, attempts=2, tokens=first[i].tokens + (result.tokens or 0))
        first[i] = Checked(retry.result, retry.verdict, retry.problem or first[i].problem, 2, retry.tokens)
    return first


class CaptionBatch:
    """Ray Data `map_batches` callable: one captioner per actor, built in the constructor.

    Input columns: content_id, image (bytes), original_caption (optional). Output: content_id,
    caption ("" on failure), captioner_id, captioner_version, prompt_version, word_count, error
    ("" when ok), num_generated_tokens (0 where unknown; both attempts of a retried caption),
    finish_reason, verdict, problem, attempts (`checked_captions`). The image bytes are not passed on.
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
        checked = checked_captions(self.captioner, images, [to_optional_str(value) for value in originals])
        results = [c.result for c in checked]
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
            "num_generated_tokens": np.array([c.tokens for c in checked], dtype=np.int64),
            "finish_reason": np.array([result.finish_reason or "" for result in results], dtype=object),
            "verdict": np.array([c.verdict for c in checked], dtype=object),
            "problem": np.array([c.problem for c in checked], dtype=object),
            "attempts": np.array([c.attempts for c in checked], dtype=np.int64),
        }
