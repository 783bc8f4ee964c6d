"""Models and policy: the captioner, the caption labeler, the caption embedder and the skip policy.

Each resource turns its fields into a `prx_core` config whose `version()` becomes the
`code_version` of the assets it drives, so changing a model, the prompt or the policy marks
exactly those assets stale in the UI.
"""

from __future__ import annotations

from typing import Any, Literal

import dagster as dg
from pydantic import Field, field_validator

from prx_core.models.caption_base import CaptionerConfig
from prx_core.models.caption_text import DEFAULT_MAX_CAPTION_CHARS
from prx_core.models.embeddings import MODEL_PACKAGE, EmbedderConfig
from prx_core.models.label_base import LabelerConfig
from prx_core.models.prompts import PROMPT_VERSION
from prx_core.stages.skip_lists.stage import SKIP_LABELS, SkipPolicy
from prx_core.store.credentials import refuse_literal_secrets


def no_secret_values(value: Any, info: Any) -> Any:
    """These fields are stored in every run's job snapshot and shipped to Ray (runtime_env): a
    token in them would be persisted, so it is refused (the workers' own env must carry it)."""
    refuse_literal_secrets(value, info.field_name)
    return value


class CaptionerResource(dg.ConfigurableResource):
    """Re-captioning backend: `source` copies the source caption (demo default); `transformers`
    runs a local Hugging Face VLM checkpoint in Ray actors; `openai` calls an OpenAI-compatible
    chat-completions endpoint from Ray actors (prx_core.models.captioning_openai); `vllm` runs the model on Ray GPU
    workers through `ray.data.llm` (prx_core.models.captioning_vllm; vLLM must be installed in those
    workers' environment, not here). The vllm fields are optional: left unset they keep
    CaptionerConfig's defaults; none of them enters the code_version except the output-changing
    engine_kwargs (dtype, quantization, revision, tokenizer_revision, seed, hf_overrides)."""

    backend: str = Field(default="source", description="source | transformers | openai | vllm")
    model: str = Field(
        default="",
        description="Local checkpoint directory (transformers); Hub id or directory (vllm); served model name (openai).",
    )
    prompt_version: str = Field(default=PROMPT_VERSION, description="Version of prx_core.models.prompts.CAPTION_PROMPT.")
    max_new_tokens: int = Field(default=256, description="Generation budget per caption.")
    temperature: float = Field(default=0.0, description="0 means greedy decoding.")
    top_p: float = Field(default=1.0, description="Nucleus sampling mass when temperature > 0.")
    max_pixels: int = Field(default=448 * 448, description="Pixel cap of the image sent to the model.")
    batch_size: int = Field(default=8, description="Images per model call.")
    actors: int = Field(default=1, description="Ray actors (model replicas) captioning in parallel.")
    tensor_parallel_size: int | None = Field(default=None, description="vllm: GPUs per engine replica (default 1).")
    replicas: int | None = Field(default=None, description="vllm: engine replicas, the Ray Data concurrency (default 1).")
    max_model_len: int | None = Field(default=None, description="vllm: context length reserved per sequence (default 4096).")
    accelerator_type: str | None = Field(default=None, description='vllm: Ray accelerator type of the engine workers, e.g. "H200".')
    engine_kwargs: dict[str, Any] | None = Field(default=None, description="vllm: extra vLLM engine arguments, passed as is.")
    runtime_env: dict[str, Any] | None = Field(default=None, description="vllm: Ray runtime_env of the vLLM workers.")
    size_from_gpu: bool | None = Field(default=None, description="vllm: max_num_seqs and (at least) batch_size from the "
                                       "model's KV cache per request and the GPU's memory where both are known "
                                       "(default true; docs/captioning.md).")
    # openai: an OpenAI-compatible endpoint (`vllm serve`, a hosted VLM) called from the Ray actors.
    # Left unset they keep CaptionerConfig's defaults; none enters the code_version (only the
    # served model name, prompt, sampling, max_new_tokens and max_pixels do).
    endpoint: str | None = Field(default=None, description="openai: base URL, e.g. http://vllm:8000/v1 (required for openai).")
    api_key_env: str | None = Field(default=None, description="openai: NAME of the env var holding the API key (never the key itself).")
    concurrency: int | None = Field(default=None, description="openai: requests in flight per actor, capped by batch_size (default 8).")
    timeout_s: float | None = Field(default=None, description="openai: deadline of one request attempt in seconds (default 120).")
    max_retries: int | None = Field(default=None, description="openai: retries on 429/5xx/timeouts/connection errors, backoff with jitter (default 4).")

    _no_secrets = field_validator("engine_kwargs", "runtime_env")(no_secret_values)
    max_response_bytes: int | None = Field(default=None, description="openai: a bigger response body is a failed request (default 8 MiB).")
    allow_insecure_http: bool | None = Field(default=None, description="openai: allow sending the API key over plain "
                                             "http:// to a host that is not loopback (default false: refused).")
    max_caption_chars: int = Field(default=DEFAULT_MAX_CAPTION_CHARS, description="Every caption (source captions at "
                                   "ingest, generated ones) is cleaned of control characters and cut to this many "
                                   "characters at a word boundary (prx_core.models.caption_text).")

    dtype: str = Field(default="float32", description="transformers: weights dtype, float32 | bfloat16 (bfloat16 to "
                                                         "fuse captioning with text latents: text_latents.fused).")
    # The caption checks (prx_core.models.caption_checks): every generated caption is judged before it
    # is stored; a refused one is generated once more with the fallback decoding, then stored rejected
    # (never shipped). Unset, they keep CaptionerConfig's defaults; set otherwise, they enter the code_version.
    min_words: int | None = Field(default=None, description="A generated caption of fewer words is refused "
                                  "(too_short; default 30: the prompt asks for 100-200).")
    max_words: int | None = Field(default=None, description="A caption of more words is refused (too_long; default "
                                  "300); a source caption is only flagged.")
    fallback_repetition_penalty: float | None = Field(default=None, description="The retry's repetition penalty "
                                                      "(default 1.2; 1.0: none).")
    fallback_temperature: float | None = Field(default=None, description="The retry's temperature (default 0: "
                                               "greedy; e.g. 0.3 samples it, seeded).")
    check_captions: bool | None = Field(default=None, description="false: generated captions are stored unchecked "
                                        "(a captioner whose output is checked elsewhere; default true).")

    def config(self) -> CaptionerConfig:
        names = ("tensor_parallel_size", "replicas", "max_model_len", "accelerator_type", "engine_kwargs", "runtime_env",
                 "endpoint", "api_key_env", "concurrency", "timeout_s", "max_retries", "max_response_bytes",
                 "allow_insecure_http", "min_words", "max_words", "fallback_repetition_penalty", "fallback_temperature",
                 "check_captions", "size_from_gpu")
        optional = {k: getattr(self, k) for k in names if getattr(self, k) is not None}
        return CaptionerConfig(
            backend=self.backend, model=self.model, prompt_version=self.prompt_version,
            max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
            max_pixels=self.max_pixels, batch_size=self.batch_size, max_caption_chars=self.max_caption_chars,
            dtype=self.dtype, **optional,
        )

    def caption_cap_version(self) -> str:
        """Changes which source captions are cut: part of the code version of `samples`."""
        return f"cap{self.max_caption_chars}"


class LabelerResource(dg.ConfigurableResource):
    """Caption labeller (visual / text / nsfw): MiniLM on the CPU (`minilm`: a head trained on labelled
    captions, or zero-shot cosine to label descriptions: `method`), or a text
    LLM (`llm`) behind an OpenAI-compatible endpoint (`transport: openai`, prx_core.models.labels_llm) or
    on Ray GPU workers through `ray.data.llm` (`transport: vllm`, prx_core.models.labels_vllm). The llm
    fields are optional; left unset they keep LabelerConfig's defaults. Model, temperature,
    max_tokens, constrained, thinking (and the instruction version, and for vllm the
    output-changing engine settings) enter the code_version; placement and transport do not."""

    backend: str = Field(default="minilm", description="minilm | llm")
    method: str | None = Field(default=None, description="minilm: head (default; a classifier over the caption "
                               "embedding, prx_core.models.label_head) | similarity (cosine to label descriptions).")
    text_threshold: float | None = Field(default=None, description="Override of the text threshold (minilm: a "
                                         "probability for head, a cosine for similarity).")
    nsfw_threshold: float | None = Field(default=None, description="Override of the nsfw threshold (minilm: a "
                                         "probability for head, a cosine for similarity).")
    explicit_terms: bool | None = Field(default=None, description="minilm: a caption with an explicit term "
                                        "(prx_core.models.label_terms) is nsfw (default: on for head, off for "
                                        "similarity).")
    actors: int = Field(default=1, description="Ray actors labelling in parallel.")
    model: str | None = Field(default=None, description="llm: served model name, e.g. Qwen/Qwen3-8B (required for llm).")
    endpoint: str | None = Field(default=None, description="llm: OpenAI-compatible base URL, e.g. http://vllm:8000/v1.")
    api_key_env: str | None = Field(default=None, description="llm: NAME of the env var holding the API key (never the key itself).")
    concurrency: int | None = Field(default=None, description="llm: requests in flight per actor (default 16).")
    timeout_s: float | None = Field(default=None, description="llm: per-request timeout in seconds (default 30).")
    max_retries: int | None = Field(default=None, description="llm: retries on 408/409/429/5xx, timeouts, connection errors (default 4).")
    max_response_bytes: int | None = Field(default=None, description="llm: a bigger response body is a failed request (default 8 MiB).")
    allow_insecure_http: bool | None = Field(default=None, description="llm: allow sending the API key over plain "
                                             "http:// to a host that is not loopback (default false: refused).")
    temperature: float | None = Field(default=None, description="llm: sampling temperature (default 0).")
    max_tokens: int | None = Field(default=None, description="llm: answer token budget (default 16).")
    constrained: str | None = Field(default=None, description="llm: output constraint: none (default) | json_schema (OpenAI response_format enum) | structured_outputs (vLLM >= 0.10.2) | guided_choice (vLLM < 0.12; newer servers ignore it).")
    thinking: bool | None = Field(default=False, description="llm: chat_template_kwargs.enable_thinking (Qwen3); "
                                  "null sends nothing, for endpoints that reject unknown fields.")
    transport: str | None = Field(default=None, description="llm: openai (endpoint, default) | vllm (ray.data.llm on GPU workers).")
    replicas: int | None = Field(default=None, description="llm/vllm: engine replicas (default 1).")
    tensor_parallel_size: int | None = Field(default=None, description="llm/vllm: GPUs per engine replica (default 1).")
    max_model_len: int | None = Field(default=None, description="llm/vllm: context length per sequence (default 2048).")
    accelerator_type: str | None = Field(default=None, description='llm/vllm: Ray accelerator type, e.g. "H200".')
    engine_kwargs: dict[str, Any] | None = Field(default=None, description="llm/vllm: extra vLLM engine arguments, as is.")
    runtime_env: dict[str, Any] | None = Field(default=None, description="llm/vllm: Ray runtime_env of the vLLM workers.")

    _no_secrets = field_validator("engine_kwargs", "runtime_env")(no_secret_values)

    def uses_gpus(self) -> bool:
        """Labels on the cluster's GPU workers (vLLM), which share the `gpu` pool with captioning;
        MiniLM on CPUs and an external endpoint take no GPU of ours."""
        return self.backend == "llm" and self.transport == "vllm"

    def config(self) -> LabelerConfig:
        names = ("method", "text_threshold", "nsfw_threshold", "explicit_terms", "model", "endpoint", "api_key_env", "concurrency",
                 "timeout_s", "max_retries", "max_response_bytes", "allow_insecure_http", "temperature", "max_tokens",
                 "constrained", "transport", "replicas", "tensor_parallel_size", "max_model_len", "accelerator_type",
                 "engine_kwargs", "runtime_env")
        overrides = {k: getattr(self, k) for k in names if getattr(self, k) is not None}
        return LabelerConfig(backend=self.backend, thinking=self.thinking, **overrides)


class EmbedderResource(dg.ConfigurableResource):
    """Caption embedder of `caption_embeddings`: the packaged all-MiniLM-L6-v2 sentence model on
    the CPU (384-d unit vectors, offline). The model enters the code_version; batch_size and
    actors do not (they change speed, never a vector)."""

    model: str = Field(default=MODEL_PACKAGE, description=f"Sentence model; only {MODEL_PACKAGE} (packaged, offline) for now.")
    batch_size: int = Field(default=256, description="Captions per model call.")
    actors: int = Field(default=1, description="Ray actors (model replicas, one CPU each) embedding in parallel.")

    def config(self) -> EmbedderConfig:
        return EmbedderConfig(model=self.model, batch_size=self.batch_size)


class SkipPolicyResource(dg.ConfigurableResource):
    """What training skips (without rewriting shards)."""

    duplicates: bool = Field(default=True, description="Skip duplicates that lose to their group's keeper.")
    labels: list[str] = Field(default_factory=lambda: list(SKIP_LABELS), description="Caption labels to skip.")
    opt_out: list[str] = Field(default_factory=list, description="source_keys or sample_ids to skip (opt-outs).")
    unlabelled: bool = Field(default=True, description="While `labels` is not empty, also skip samples without a "
                                                       "label (a labeller failure below caption_labels_coverage's "
                                                       "threshold): their label is unknown.")
    duplicates_rule: Literal["keys", "phash"] = Field(
        default="keys", description="How `duplicates` finds copies: `keys` (pHash match keys, each pair confirmed by "
                                    "a 16x16 signature; docs/benchmarks.md) or `phash` (identical pHash, unconfirmed: "
                                    "the first release's rule, kept for comparison).")

    def policy(self) -> SkipPolicy:
        return SkipPolicy(self.duplicates, tuple(self.labels), tuple(self.opt_out), self.unlabelled)
