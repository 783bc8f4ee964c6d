"""What every captioner backend shares: the config with its id and version, the result, the
`Captioner` base class and the image and cell helpers. Its own module so backends import it
without importing the registry (`prx_core.models.captioning`), which imports them."""

from __future__ import annotations

import hashlib
import json
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
from PIL import Image

from prx_core.image.decode import Rejection, decode_image
from prx_core.models.caption_checks import DEFAULT_MAX_WORDS, DEFAULT_MIN_WORDS
from prx_core.models.caption_keys import SOURCE_VERSION_PREFIX
from prx_core.models.caption_text import DEFAULT_MAX_CAPTION_CHARS, check_max_chars, clean_caption
from prx_core.models.openai_http import DEFAULT_MAX_RESPONSE_BYTES, check_endpoint
from prx_core.models.prompts import CAPTION_PROMPT, PROMPT_VERSION

SOURCE = "source"
TRANSFORMERS = "transformers"
OPENAI = "openai"  # any OpenAI-compatible chat-completions endpoint (vllm serve, a hosted VLM)
VLLM = "vllm"  # a whole Ray Data stage (prx_core.models.captioning_vllm), not a per-batch Captioner
KNOWN_BACKENDS: tuple[str, ...] = (SOURCE, TRANSFORMERS, OPENAI, VLLM)
DTYPES = ("float32", "bfloat16")  # transformers captioner weights
MIN_MAX_PIXELS = 28 * 28  # one merged Qwen-VL patch; anything smaller cannot be seen at all

# vllm engine_kwargs that change what is generated (the others change only speed or memory)
OUTPUT_ENGINE_KWARGS = ("dtype", "quantization", "revision", "tokenizer_revision", "seed", "hf_overrides")

# Stable reason codes, the part of `CaptionResult.error` before the first ": ".
NO_SOURCE_CAPTION = "no_source_caption"
DECODE_ERROR = "decode_error"
GENERATION_ERROR = "generation_error"
EMPTY_CAPTION = "empty_caption"

FALLBACK_REPETITION_PENALTY = 1.2
DEFAULT_CHECK_SETTINGS = {"min_words": DEFAULT_MIN_WORDS, "max_words": DEFAULT_MAX_WORDS,
                          "fallback_repetition_penalty": FALLBACK_REPETITION_PENALTY, "fallback_temperature": 0.0,
                          "check_captions": True}

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
TEXT_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken")  # config, tokenizer, template
SAMPLE_BYTES, SAMPLE_WINDOWS = 256 << 10, 65


@dataclass(frozen=True)
class CaptionerConfig:
    """Everything that selects a captioner; `version()` hashes the parts that change its output."""

    backend: str
    model: str = ""  # transformers: a local Hugging Face checkpoint directory; openai: the served model name
    prompt_version: str = PROMPT_VERSION
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    max_pixels: int = 448 * 448  # pixel cap of the image sent to the model
    batch_size: int = 8
    # openai backend only; none of these changes the output, so none enters version().
    endpoint: str = ""  # base URL, e.g. http://host:8000/v1 (".../chat/completions" is appended)
    api_key_env: str = ""  # NAME of the environment variable holding the API key, never the key
    concurrency: int = 8  # requests in flight per captioner (per Ray actor; capped by batch_size per call)
    timeout_s: float = 120.0  # per request attempt
    max_retries: int = 4  # extra attempts on 429, 5xx, timeouts and connection errors
    backoff_s: float = 0.5  # first backoff; doubles per attempt, full jitter, capped at 30 s
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES  # a bigger response body is a failed request
    allow_insecure_http: bool = False  # send the API key over plain http:// to a non-loopback host
    # vllm backend only (`model`: a Hub id or a local checkpoint directory); of these, only the
    # output-changing OUTPUT_ENGINE_KWARGS enter version().
    tensor_parallel_size: int = 1  # GPUs per vLLM replica
    replicas: int = 1  # vLLM engine replicas (the Ray Data actor pool size)
    max_model_len: int = 4096  # prompt (~250 text + image tokens) plus max_new_tokens must fit
    accelerator_type: str | None = None  # Ray accelerator type of the engine workers, e.g. "H200"
    # max_num_seqs and (at least) batch_size from the model's KV cache per request and the GPU's memory,
    # where both are known (prx_core.models.engine_sizing); false: batch_size and engine_kwargs as given
    size_from_gpu: bool = True
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict, hash=False)  # to vLLM as is
    runtime_env: Mapping[str, Any] = field(default_factory=dict, hash=False)  # Ray env with vLLM
    # source backend only: a stand-in model cost per image (benchmarks measure the orchestration
    # around a model with it). It enters version(), so stand-in captions are never reused as real ones.
    seconds_per_image: float = 0.0
    # every backend: captions (generated, and source captions at ingest) are cleaned and cut to
    # this many characters (prx_core.models.caption_text); enters version() when not the default.
    max_caption_chars: int = DEFAULT_MAX_CAPTION_CHARS
    # transformers backend only: the weights' dtype; bfloat16 is what text latents are computed in,
    # so a captioner fused with the text-latent encoder loads it. Enters version() when not float32.
    dtype: str = "float32"
    # model backends: every generated caption is checked before it is stored
    # (prx_core.models.caption_checks); one that fails is generated once more with the fallback
    # decoding below, and a second failure is stored as `rejected` and never shipped. Each enters
    # version() when not the default (they change what is stored; defaults keep earlier versions).
    min_words: int = DEFAULT_MIN_WORDS  # fewer words: too_short (the prompt asks for 100-200)
    max_words: int = DEFAULT_MAX_WORDS  # more words: too_long (a source caption is only flagged)
    fallback_repetition_penalty: float = FALLBACK_REPETITION_PENALTY  # the retry's (1.0: none); breaks greedy loops
    fallback_temperature: float = 0.0  # the retry's temperature (0: greedy; e.g. 0.3 samples it, seeded)
    check_captions: bool = True  # False: generated captions are stored `unchecked` (a captioner checked elsewhere)

    def __post_init__(self) -> None:
        if self.backend not in KNOWN_BACKENDS:
            raise ValueError(f"unknown captioner backend {self.backend!r}; known backends: {', '.join(KNOWN_BACKENDS)}")
        if self.backend == TRANSFORMERS and not self.model:
            raise ValueError("the transformers backend needs `model`: a local checkpoint directory")
        if self.backend == OPENAI and not (self.model and self.endpoint):
            raise ValueError("the openai backend needs `model` (the served model name) and `endpoint` (base URL)")
        if self.backend == VLLM and not self.model:
            raise ValueError("the vllm backend needs `model`: a Hugging Face id or a checkpoint directory")
        if min(self.tensor_parallel_size, self.replicas, self.max_model_len) < 1:
            raise ValueError("tensor_parallel_size, replicas and max_model_len must be at least 1")
        if self.concurrency < 1 or self.max_retries < 0 or self.timeout_s <= 0 or self.backoff_s < 0:
            raise ValueError("need concurrency >= 1, max_retries >= 0, timeout_s > 0 and backoff_s >= 0")
        if self.max_new_tokens < 1 or self.batch_size < 1:
            raise ValueError("max_new_tokens and batch_size must be at least 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {self.temperature}, {self.top_p}")
        if self.max_pixels < MIN_MAX_PIXELS:
            raise ValueError(f"max_pixels must be at least {MIN_MAX_PIXELS}, got {self.max_pixels}")
        check_max_chars(self.max_caption_chars)
        if not 0 <= self.min_words <= self.max_words:
            raise ValueError(f"need 0 <= min_words <= max_words, got {self.min_words} and {self.max_words}")
        if self.fallback_repetition_penalty <= 0 or self.fallback_temperature < 0:
            raise ValueError("need fallback_repetition_penalty > 0 and fallback_temperature >= 0")
        if self.dtype not in DTYPES:
            raise ValueError(f"captioner.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.backend == OPENAI:
            check_endpoint(self.endpoint, self.api_key_env, self.allow_insecure_http, self.max_response_bytes)

    def captioner_id(self) -> str:
        """Human-readable and stable: "source" or "<backend>:<model name>:<12 hex of version>"."""
        if self.backend == SOURCE:
            return SOURCE
        return f"{self.backend}:{Path(self.model.rstrip('/')).name}:{self.version()[:12]}"

    def version(self) -> str:
        """16 hex digits of `version_inputs()`; the `source` captioner's carry SOURCE_VERSION_PREFIX,
        which tells every stage its captions are keyed per sample text (prx_core.models.caption_keys)."""
        digest = hashlib.sha256(json.dumps(self.version_inputs(), sort_keys=True).encode()).hexdigest()[:16]
        return SOURCE_VERSION_PREFIX + digest if self.backend == SOURCE else digest

    def version_inputs(self) -> dict[str, Any]:
        """What the output depends on; batch_size does not (one result per image either way)."""
        if self.backend == SOURCE:  # no model, prompt, sampling or pixels
            stand_in = {"stand_in_seconds_per_image": self.seconds_per_image} if self.seconds_per_image else {}
            # "per-sample-by-content": each sample's own caption, cleaned and capped, keyed by the
            # content id and a hash of (content, text) (was "per-sample": the hash alone, which
            # scattered a content unit's keys; before that "clean": keyed by content and shared,
            # so a sample could ship another source's text; before that "strip"); a stand-in
            # never reuses real captions
            return {"backend": SOURCE, "rule": "per-sample-by-content", "max_caption_chars": self.max_caption_chars,
                    **stand_in}
        sampling: dict[str, float] = {"temperature": float(self.temperature)}
        if self.temperature > 0:  # greedy decoding ignores top_p
            sampling["top_p"] = float(self.top_p)
        inputs = {
            "backend": self.backend,
            # An endpoint is identified by the model name it serves (its URL and the client's
            # concurrency/timeouts do not change the output); a local checkpoint by its content.
            "model": self.model if self.backend == OPENAI else self.model_identity(),
            "prompt_version": self.prompt_version,
            "prompt_sha256": hashlib.sha256(CAPTION_PROMPT.encode()).hexdigest(),
            "sampling": sampling,
            "max_new_tokens": self.max_new_tokens,
            "max_pixels": self.max_pixels,
        }
        if self.max_caption_chars != DEFAULT_MAX_CAPTION_CHARS:  # the default keeps earlier versions valid
            inputs["max_caption_chars"] = self.max_caption_chars
        if self.backend == TRANSFORMERS and self.dtype != "float32":  # float32 keeps earlier versions valid
            inputs["dtype"] = self.dtype
        checks = self.check_settings()
        if checks != DEFAULT_CHECK_SETTINGS:  # the defaults keep earlier versions valid
            inputs["checks"] = checks
        if self.backend == VLLM:
            inputs["engine"] = {k: self.engine_kwargs[k] for k in OUTPUT_ENGINE_KWARGS if k in self.engine_kwargs}
        return inputs

    def check_settings(self) -> dict[str, Any]:
        """What the caption checks and the retry depend on (version_inputs, when not the default)."""
        return {"min_words": self.min_words, "max_words": self.max_words,
                "fallback_repetition_penalty": float(self.fallback_repetition_penalty),
                "fallback_temperature": float(self.fallback_temperature), "check_captions": bool(self.check_captions)}

    def decoding(self, fallback: bool = False) -> tuple[float, float | None]:
        """(temperature, repetition penalty or None) of a generation, or of the fallback's (the retry
        of a caption the checks refused): what every model backend sends its model."""
        if not fallback:
            return float(self.temperature), None
        penalty = self.fallback_repetition_penalty
        return float(self.fallback_temperature), (float(penalty) if penalty != 1.0 else None)

    def model_identity(self) -> str:
        """A local checkpoint by content; for vllm a Hub id as written (pin a `revision` in
        engine_kwargs to make it content-stable)."""
        path = Path(self.model)
        if self.backend == VLLM and not (path / "config.json").is_file():
            return f"hub:{self.model}"
        return fingerprint_checkpoint(path)

    def recorded_prompt_version(self) -> str:
        """The prompt version stored with each caption; a copied source caption used none."""
        return "" if self.backend == SOURCE else self.prompt_version


def fingerprint_checkpoint(path: Path) -> str:
    """Identity of a local checkpoint by content, not location: config, tokenizer and template
    files in full, weight files by name, size and sampled content (hashing 16 GB of weights in
    full would cost a minute every time a version is computed)."""
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a local Hugging Face checkpoint (no config.json)")
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        relative = file.relative_to(path)
        if any(part.startswith(".") for part in relative.parts) or file.suffix not in WEIGHT_SUFFIXES + TEXT_SUFFIXES:
            continue  # README, images, .gitattributes, our build marker: they do not change the output
        size = file.stat().st_size
        digest.update(f"{relative.as_posix()}\0{size}\0{hash_file(file, size)}\n".encode())
    return digest.hexdigest()


def hash_file(file: Path, size: int) -> str:
    """Small files in full; a weight file by 65 evenly spaced windows, first and last included,
    so a fine-tune of the middle layers changes it while the cost stays ~16 MiB per file."""
    if file.suffix not in WEIGHT_SUFFIXES or size <= SAMPLE_WINDOWS * SAMPLE_BYTES:
        return hashlib.sha256(file.read_bytes()).hexdigest()
    digest = hashlib.sha256()
    with file.open("rb") as handle:
        for k in range(SAMPLE_WINDOWS):
            handle.seek((size - SAMPLE_BYTES) * k // (SAMPLE_WINDOWS - 1))
            digest.update(handle.read(SAMPLE_BYTES))
    return digest.hexdigest()


@dataclass(frozen=True)
class CaptionResult:
    """A caption, or `error` = "<reason code>: <message>"; exactly one of them is set."""

    caption: str | None
    error: str | None = None
    tokens: int | None = field(default=None, compare=False)  # generated tokens where known (accounting only)
    finish_reason: str | None = field(default=None, compare=False)  # "stop", "length" (the token cap); None: unknown

    def __post_init__(self) -> None:
        if (self.caption is None) == (self.error is None):
            raise ValueError("a CaptionResult holds either a caption or an error")

    @classmethod
    def failed(cls, reason: str, message: str) -> CaptionResult:
        return cls(None, f"{reason}: {message}"[:500])

    @property
    def reason(self) -> str | None:
        return None if self.error is None else self.error.split(": ", 1)[0]


class Captioner(ABC):
    """Captions a batch of images; one result per input, in input order, never raising for
    a bad input (only for a caller's mistake, such as mismatched lengths)."""

    def __init__(self, config: CaptionerConfig) -> None:
        self.config = config

    @abstractmethod
    def caption_batch(self, images: Sequence[bytes], original_captions: Sequence[str | None],
                      fallback: bool = False) -> list[CaptionResult]:
        """Caption `images`; `original_captions` are the source's captions, aligned with them.
        `fallback`: the config's fallback decoding (the retry of a caption the checks refused)."""




def prepare_image(data: bytes, max_pixels: int) -> Image.Image | CaptionResult:
    """Decode safely and shrink to at most `max_pixels`; a refusal becomes a result."""
    side = math.ceil(math.sqrt(max_pixels))  # a JPEG DCT-scaled to >= side x side still covers
    decoded = decode_image(data, min_size=(side, side))  # the area-capped size, whatever the aspect
    if isinstance(decoded, Rejection):
        return CaptionResult.failed(f"{DECODE_ERROR}:{decoded.reason}", decoded.message)
    return shrink_to_pixels(decoded.image, max_pixels)


def shrink_to_pixels(image: Image.Image, max_pixels: int) -> Image.Image:
    width, height = image.size
    if width * height <= max_pixels:
        return image
    scale = math.sqrt(max_pixels / (width * height))
    size = (max(1, math.floor(width * scale)), max(1, math.floor(height * scale)))
    return image.resize(size, Image.Resampling.BICUBIC, reducing_gap=2.0)


def generated_caption(text: object, max_chars: int, tokens: int | None = None,
                      empty: str = "the model generated no text", finish_reason: str | None = None) -> CaptionResult:
    """A model's answer as a stored caption: cleaned and capped like every caption
    (prx_core.models.caption_text); nothing left is an `empty_caption` failure."""
    caption = clean_caption(text, max_chars).text
    if not caption:
        return replace(CaptionResult.failed(EMPTY_CAPTION, empty), finish_reason=finish_reason)
    return CaptionResult(caption, tokens=tokens, finish_reason=finish_reason)


def check_lengths(images: Sequence[bytes], original_captions: Sequence[str | None]) -> None:
    if len(images) != len(original_captions):
        raise ValueError(f"{len(images)} images but {len(original_captions)} original captions")




def word_count(text: str) -> int:
    return len(text.split())


def to_bytes(value: Any) -> bytes:
    """A Ray/Arrow binary cell as bytes (bytes, numpy bytes, uint8 array or None)."""
    return b"" if value is None else value.tobytes() if isinstance(value, np.ndarray) else bytes(value)


def to_optional_str(value: Any) -> str | None:
    """A Ray/Arrow/pandas string cell as str; null and NaN become None."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", errors="replace")
    return str(value)
