"""What every labeller backend shares: the config with its id and version (the llm backend's
fields validated and hashed here too), the result, the decision rule and the `Labeler` base
class. Its own module so backends import it without importing the registry
(`prx_core.models.labels`), which imports them."""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prx_core.models.caption_base import OUTPUT_ENGINE_KWARGS
from prx_core.models.embeddings import model_identity
from prx_core.models.openai_http import DEFAULT_MAX_RESPONSE_BYTES, check_endpoint
from prx_core.models.prompts import LABEL_INSTRUCTION, LABEL_INSTRUCTION_VERSION

LABELS = ("visual", "text", "nsfw")
BACKENDS = ("minilm", "llm")  # llm: prx_core.models.labels_llm (an LLM over the caption, OpenAI-compatible or vLLM)
# minilm: `head`, a classifier over the caption embedding and words (prx_core.models.label_head, chosen on
# held-out captions: docs/benchmarks.md), or `similarity`, the best cosine to the label descriptions below;
# with `explicit_terms` (the head's default) a caption with an explicit term is nsfw (label_terms).
METHODS = ("head", "similarity")
SIMILARITY_THRESHOLDS = {"text_threshold": 0.33, "nsfw_threshold": 0.45}  # cosines, calibrated with the descriptions

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

CONSTRAINED = ("none", "json_schema", "structured_outputs", "guided_choice")
# What each `constrained` value asks of the model: the two vLLM spellings are one constraint, so
# moving a config to the new spelling when the server is upgraded does not re-label the corpus.
CONSTRAINT_KIND = {"none": "none", "json_schema": "json_schema", "structured_outputs": "choice", "guided_choice": "choice"}
TRANSPORTS = ("openai", "vllm")


@dataclass(frozen=True)
class LabelerConfig:
    """What decides a label. minilm: the method, its thresholds (and the head's digest, or the
    descriptions) go into `version()`, `batch_size` does not.
    llm: model, instruction (version and text), temperature, max_tokens, the constraint, `thinking`
    and output-changing vllm engine_kwargs go into `version()`; transport (endpoint, key,
    concurrency, timeouts, retries, replicas, GPUs) does not."""

    backend: str = "minilm"
    method: str = "head"  # minilm: head | similarity (METHODS)
    descriptions: tuple[tuple[str, tuple[str, ...]], ...] = DEFAULT_DESCRIPTIONS  # similarity only
    # text wins at or above this, if it also beats visual; nsfw at or above its own, whatever the
    # other scores. Probabilities for `head` (None: the head's cross-validated ones), cosines for
    # `similarity` (None: SIMILARITY_THRESHOLDS).
    text_threshold: float | None = None
    nsfw_threshold: float | None = None
    # minilm: a caption with an explicit term (prx_core.models.label_terms) scores nsfw 1.0, so is nsfw.
    # None: on for `head` (its thresholds were chosen with it), off for `similarity`.
    explicit_terms: bool | None = None
    batch_size: int = 256
    # --- llm backend (prx_core.models.labels_llm) ---
    model: str = ""  # served model name, e.g. "Qwen/Qwen3-8B"
    endpoint: str = ""  # OpenAI-compatible base URL, e.g. "http://vllm:8000/v1" (POST {endpoint}/chat/completions)
    api_key_env: str = ""  # NAME of the environment variable holding the API key ("" = no key); never the key
    concurrency: int = 16  # requests in flight per labeler (Ray actor)
    timeout_s: float = 30.0  # per request
    max_retries: int = 4  # on 408/409/429/5xx, timeouts and connection errors, with exponential backoff
    backoff_s: float = 1.0  # first backoff cap; doubles per retry, full jitter, Retry-After a floor (openai_http)
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES  # a bigger response body is a failed request
    allow_insecure_http: bool = False  # send the API key over plain http:// to a non-loopback host
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
        if self.method not in METHODS:
            raise ValueError(f"unknown minilm method {self.method!r}; known methods: {', '.join(METHODS)}")
        for name, value in self.default_thresholds().items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.explicit_terms is None:
            object.__setattr__(self, "explicit_terms", self.backend == "minilm" and self.method == "head")
        elif self.explicit_terms and self.backend != "minilm":
            raise ValueError("explicit_terms is a minilm option: the llm backend reads the caption itself")
        labels = [label for label, _ in descriptions]
        if sorted(labels) != sorted(LABELS):
            raise ValueError(f"descriptions must cover each of {LABELS} exactly once, got {labels}")
        for label, texts in descriptions:
            if not texts or any(not t.strip() for t in texts):
                raise ValueError(f"label {label!r} needs at least one non-blank description")
        for name in ("text_threshold", "nsfw_threshold"):
            if not -1.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} is a score in [-1, 1] (a probability for head, a cosine for similarity), "
                                 f"got {getattr(self, name)}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.backend == "llm":
            validate_llm_config(self)

    def default_thresholds(self) -> dict[str, float]:
        """The method's own thresholds, for those left None."""
        if self.backend != "minilm" or self.method == "similarity":
            return dict(SIMILARITY_THRESHOLDS)
        from prx_core.models.label_head import load_head

        head = load_head()
        return {"text_threshold": head.text_threshold, "nsfw_threshold": head.nsfw_threshold}

    def version(self) -> str:
        """SHA-256 of what changes labels: backend, model files, method and thresholds, and the
        head's digest (head) or the descriptions (similarity; their order is irrelevant to the
        max, so sorted out of the hash, and the payload is the one before heads existed, so
        similarity labels stored then stay current). The llm backend hashes its own fields
        instead (`llm_version_payload`)."""
        if self.backend == "llm":
            return hashlib.sha256(json.dumps(llm_version_payload(self), sort_keys=True).encode()).hexdigest()
        if self.method == "head":
            from prx_core.models.label_head import load_head

            payload = {"backend": self.backend, "method": "head", "model": model_identity(), "head": load_head().digest(),
                       "text_threshold": float(self.text_threshold), "nsfw_threshold": float(self.nsfw_threshold),
                       "explicit_terms": explicit_terms_version(self.explicit_terms)}
            return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
        payload = {
            "backend": self.backend,
            "model": model_identity(),
            "descriptions": {label: sorted(texts) for label, texts in self.descriptions},
            "text_threshold": float(self.text_threshold),
            "nsfw_threshold": float(self.nsfw_threshold),
        }
        if self.explicit_terms:  # only when asked for: the similarity labels stored before the terms stay current
            payload["explicit_terms"] = explicit_terms_version(True)
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def labeler_id(self) -> str:
        """Short human-readable form of the version, e.g. `minilm:3f2a9c0b1d4e`."""
        return f"{self.backend}:{self.version()[:12]}"


def explicit_terms_version(on: bool | None) -> str | None:
    """What the explicit terms add to a minilm version: the list's digest when on."""
    if not on:
        return None
    from prx_core.models.label_terms import terms_digest

    return terms_digest()


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


def validate_llm_config(config: LabelerConfig) -> None:
    """Checks of the llm fields; called from `LabelerConfig.__post_init__` for backend llm."""
    if not config.model.strip():
        raise ValueError("the llm labeler needs `model` (the served model name)")
    if config.constrained not in CONSTRAINED:
        raise ValueError(f"constrained must be one of {CONSTRAINED}, got {config.constrained!r}")
    if config.transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {config.transport!r}")
    if config.thinking is not None and not isinstance(config.thinking, bool):
        raise ValueError(f"thinking must be true, false or null, got {config.thinking!r}")
    if config.concurrency < 1 or config.max_tokens < 1 or config.max_retries < 0:
        raise ValueError("concurrency and max_tokens must be >= 1, max_retries >= 0")
    if config.timeout_s <= 0 or config.backoff_s < 0 or config.temperature < 0:
        raise ValueError("timeout_s must be > 0, backoff_s and temperature >= 0")
    if min(config.replicas, config.tensor_parallel_size, config.max_model_len) < 1:
        raise ValueError("replicas, tensor_parallel_size and max_model_len must be >= 1")
    if config.transport == "openai":
        check_endpoint(config.endpoint, config.api_key_env, config.allow_insecure_http, config.max_response_bytes)


def llm_version_payload(config: LabelerConfig) -> dict[str, Any]:
    """What changes llm labels: model, instruction (version and text), sampling, the constraint
    actually applied, thinking, output-changing vLLM engine_kwargs. Not the endpoint, key,
    concurrency, timeouts, retries, batch size, replicas or GPUs."""
    payload: dict[str, Any] = {
        "backend": "llm",
        "model": config.model,
        "instruction_version": LABEL_INSTRUCTION_VERSION,
        "instruction_sha256": hashlib.sha256(LABEL_INSTRUCTION.encode()).hexdigest(),
        "temperature": float(config.temperature),
        "max_tokens": int(config.max_tokens),
        "constrained": "choice" if config.transport == "vllm" else CONSTRAINT_KIND[config.constrained],
        "thinking": config.thinking,
    }
    if config.transport == "vllm":
        payload["engine"] = {k: config.engine_kwargs[k] for k in OUTPUT_ENGINE_KWARGS if k in config.engine_kwargs}
    return payload
