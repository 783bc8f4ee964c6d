"""The `vllm` captioner backend: a whole Ray Data stage through `ray.data.llm`.

Unlike the other backends this is not a per-batch `Captioner`: `ray.data.llm.build_processor`
turns a Ray Dataset of (content_id, image bytes, original_caption) rows into caption rows with
the same columns `CaptionBatch` yields (content_id, caption, captioner_id, captioner_version,
prompt_version, word_count, error), so `prx_core.stages.captions.stage.build_captions` upserts them the
same way. vLLM itself (which pins its own torch and transformers) is imported only inside the
engine actors, i.e. in the Ray GPU workers' environment (`CaptionerConfig.runtime_env` or the GPU
worker image); building the processor here needs Ray and transformers, not vLLM.

Per row:
- preprocess (CPU, Ray Data map): decode safely, shrink to `max_pixels`, re-encode as a JPEG
  data URL, and build the chat request: one user message [image, CAPTION_PROMPT] (the same
  message as the transformers backend) and per-row `sampling_params`. A corrupt image becomes a
  one-token text-only request flagged `decode_error`, so it costs nothing and ends as an error
  row, never as an exception.
- Ray's stages: PrepareMultimodal (vLLM parses the image out of the messages), ChatTemplate,
  Tokenize, vLLMEngine (the GPU), Detokenize.
- postprocess: `generated_text` -> caption (cleaned, capped and made one paragraph,
  prx_core.models.caption_text); per caption also `finish_reason` ("length" when the generation
  used its whole `max_tokens`, else "stop": Ray 2.60's engine stage does not pass vLLM's own on,
  and vLLM stops for length exactly there), `num_generated_tokens`, `num_input_tokens` and
  `llm_seconds` (the engine's time on the request); empty text or missing fields become
  `empty_caption` / `generation_error` rows. Rows the engine failed
  (`should_continue_on_error`, `__inference_error__` set) bypass postprocess inside Ray and are
  turned into `generation_error` rows by `finalize_row`.

The caption checks run after the pipeline (prx_core.stages.captions): a refused caption goes
through a second pipeline with `fallback=True` (the config's fallback decoding), as the other
backends retry it; the first attempt's problem and tokens ride along (CARRIED).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from prx_core.models.caption_base import (
    DECODE_ERROR,
    GENERATION_ERROR,
    VLLM,
    CaptionerConfig,
    CaptionResult,
    generated_caption,
    prepare_image,
    to_bytes,
    word_count,
)
from prx_core.models.prompts import CAPTION_PROMPT

JPEG_QUALITY = 95  # the model sees the image re-encoded once, after the pixel cap
INFERENCE_ERROR = "__inference_error__"  # Ray's column for a row the engine failed
# columns passed through the engine untouched: which work unit a row belongs to, and on the fallback
# pass the first attempt's problem and tokens (prx_core.stages.captions.quality.judged_rows)
CARRIED = ("unit_id", "first_problem", "first_tokens")
OUTPUT_COLUMNS = ("content_id", "caption", "captioner_id", "captioner_version", "prompt_version", "word_count", "error",
                  "num_generated_tokens", "num_input_tokens", "finish_reason", "llm_seconds")
CPU_STAGES = ("prepare_multimodal_stage", "chat_template_stage", "tokenize_stage", "detokenize_stage")
CPU_STAGE_CPUS = 0.1  # accelerator_type CPU: each tokenizer stage's share, so engines and tasks fit a two-CPU Ray


class EngineConfig(Protocol):
    """The vLLM fields CaptionerConfig and LabelerConfig share (the labeller reuses this module)."""

    model: str
    batch_size: int
    replicas: int
    tensor_parallel_size: int
    max_model_len: int
    accelerator_type: str | None
    engine_kwargs: Mapping[str, Any]
    runtime_env: Mapping[str, Any]


def base_engine_kwargs(config: EngineConfig, **ours: Any) -> dict[str, Any]:
    """vLLM engine arguments: parallelism, context, `ours`, then `config.engine_kwargs` overriding them."""
    return {"tensor_parallel_size": config.tensor_parallel_size, "max_model_len": config.max_model_len,
            **ours, **dict(config.engine_kwargs)}


def engine_kwargs(config: CaptionerConfig, sized: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Captioning engine arguments: one image per prompt, the model processor's own pixel cap, and
    what the sizing adds (prx_core.models.engine_sizing); the config's engine_kwargs override them."""
    return base_engine_kwargs(config, limit_mm_per_prompt={"image": 1},
                              mm_processor_kwargs={"max_pixels": config.max_pixels}, **(sized or {}))


def sampling_params(config: CaptionerConfig, fallback: bool = False) -> dict[str, Any]:
    """vLLM SamplingParams as a dict; greedy decoding when temperature is 0 (top_p then unused).
    `fallback`: the retry of a caption the checks refused (the config's fallback temperature and
    repetition penalty, seeded where it samples), as the other backends decode it."""
    temperature, penalty = config.decoding(fallback)
    params: dict[str, Any] = {
        "max_tokens": config.max_new_tokens,
        "temperature": float(temperature),
        "top_p": float(config.top_p) if temperature > 0 else 1.0,
        "detokenize": False,  # Ray's Detokenize stage decodes on CPU workers, off the engine actor
    }
    if penalty is not None:
        params["repetition_penalty"] = penalty
    if fallback and temperature > 0:
        params["seed"] = 0
    return params


def processor_config(config: EngineConfig, engine: Mapping[str, Any], batch_size: int | None = None,
                     **stages: Any) -> Any:
    """`vLLMEngineProcessorConfig` from the shared fields (`batch_size`: the config's unless given);
    `stages`: per-stage configs."""
    from ray.data.llm import vLLMEngineProcessorConfig

    return vLLMEngineProcessorConfig(
        model_source=config.model,
        batch_size=batch_size or config.batch_size,
        concurrency=config.replicas,
        engine_kwargs=dict(engine),
        runtime_env=worker_env(config.runtime_env),
        should_continue_on_error=True,  # a failed request becomes an error row, not a failed run
        **placement(config, stages),
    )


def worker_env(runtime_env: Mapping[str, Any]) -> dict[str, Any]:
    """The vLLM workers' runtime_env: the config's, plus the setup hook that lets Ray 2.60's stages
    import what newer vLLM moved (prx_core.models.vllm_compat). Ray takes `worker_process_setup_hook`
    only from ray.init's runtime_env; per stage, the hook is the variable Ray's worker start reads
    (its own name for it, ray_constants), which is what Ray sets for a module-path hook."""
    from ray._private.ray_constants import WORKER_PROCESS_SETUP_HOOK_ENV_VAR

    from prx_core.models.vllm_compat import HOOK

    env = dict(runtime_env)
    env["env_vars"] = {WORKER_PROCESS_SETUP_HOOK_ENV_VAR: HOOK, **dict(env.get("env_vars") or {})}
    return env


def placement(config: EngineConfig, stages: Mapping[str, Any]) -> dict[str, Any]:
    """Where the engines run: one replica per `tensor_parallel_size` GPUs of `accelerator_type`; with
    `accelerator_type: CPU` (vLLM's CPU build, prx_core.models.vllm_cpu) a half-CPU bundle per replica and
    the CPU stages at a tenth each: actors hold their CPUs for the whole pipeline, so on a two-CPU Ray
    anything more leaves no CPU for its tasks (read, preprocess, write) and the pipeline waits forever."""
    from prx_core.models.vllm_cpu import CPU, cpu_placement

    if (config.accelerator_type or "").upper() != CPU:
        return {"accelerator_type": config.accelerator_type, **stages}
    light = dict(stages)
    for name in CPU_STAGES:
        value = stages.get(name, name != "prepare_multimodal_stage")  # Ray's defaults: only that one is off
        if value is True or isinstance(value, Mapping):
            light[name] = {"enabled": True, "num_cpus": CPU_STAGE_CPUS, **(value if isinstance(value, Mapping) else {})}
    return {"accelerator_type": None, "placement_group_config": cpu_placement(), **light}


def build_vllm_processor_config(config: CaptionerConfig) -> Any:
    if config.backend != VLLM:
        raise ValueError(f"build_vllm_processor_config needs the vllm backend, got {config.backend!r}")
    from prx_core.models.engine_sizing import sized_settings

    batch_size, engine = sized_settings(config)
    return processor_config(config, engine_kwargs(config, engine), batch_size, prepare_multimodal_stage={"enabled": True})


def image_data_url(data: bytes, max_pixels: int) -> str | CaptionResult:
    """The image as a `data:image/jpeg;base64,...` URL after the pixel cap, or a decode failure."""
    prepared = prepare_image(data, max_pixels)
    if isinstance(prepared, CaptionResult):
        return prepared
    buffer = io.BytesIO()
    image = prepared if prepared.mode == "RGB" else prepared.convert("RGB")
    image.save(buffer, format="JPEG", quality=JPEG_QUALITY)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


class Preprocess:
    """Row -> vLLM request; picklable, so Ray ships it to map workers."""

    def __init__(self, config: CaptionerConfig, fallback: bool = False) -> None:
        self.config = config
        self.sampling = sampling_params(config, fallback)

    def __call__(self, row: Mapping[str, Any]) -> dict[str, Any]:
        content_id = str(row["content_id"])
        try:
            url = image_data_url(to_bytes(row.get("image")), self.config.max_pixels)
        except Exception as exc:  # decode_image refuses bad input itself; this is a last resort
            url = CaptionResult.failed(DECODE_ERROR, f"{type(exc).__name__}: {exc}")
        if isinstance(url, CaptionResult):  # no image to send: a one-token text-only request
            return {
                "content_id": content_id, "image": b"", "decode_error": url.error,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "."}]}],
                "sampling_params": {**self.sampling, "max_tokens": 1}, **carried(row),
            }
        return {  # "image": b"" drops the bytes Ray would otherwise carry through every stage
            "content_id": content_id, "image": b"", "decode_error": "",
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": CAPTION_PROMPT},
            ]}],
            "sampling_params": dict(self.sampling), **carried(row),
        }


class Postprocess:
    """vLLM output row -> caption row with the columns of `CaptionBatch` (+ num_generated_tokens)."""

    def __init__(self, config: CaptionerConfig) -> None:
        self.captioner_id = config.captioner_id()
        self.version = config.version()
        self.prompt_version = config.recorded_prompt_version()
        self.max_caption_chars = config.max_caption_chars
        self.max_tokens = config.max_new_tokens

    def __call__(self, row: Mapping[str, Any]) -> dict[str, Any]:
        tokens = row.get("num_generated_tokens")
        tokens = 0 if tokens is None or row.get("decode_error") else int(tokens)
        if row.get("decode_error"):
            result = CaptionResult(None, str(row["decode_error"]))
        elif row.get(INFERENCE_ERROR):
            result = CaptionResult.failed(GENERATION_ERROR, str(row[INFERENCE_ERROR]))
        elif row.get("generated_text") is None:
            result = CaptionResult.failed(GENERATION_ERROR, "the engine returned no generated_text")
        else:
            result = generated_caption(row["generated_text"], self.max_caption_chars)
            if result.caption is not None:  # one paragraph, as asked (never longer than cleaned)
                result = CaptionResult(" ".join(result.caption.split()))
        caption = result.caption or ""
        return {
            "content_id": str(row["content_id"]),
            "caption": caption,
            "captioner_id": self.captioner_id,
            "captioner_version": self.version,
            "prompt_version": self.prompt_version,
            "word_count": word_count(caption),
            "error": result.error or "",
            **engine_accounting(row, tokens, self.max_tokens),
            **carried(row),
        }


def engine_accounting(row: Mapping[str, Any], tokens: int, max_tokens: int) -> dict[str, Any]:
    """What the engine reports of one request: tokens in and out, why it stopped ("" where nothing
    was generated), and its seconds in the engine (0.0 where unknown)."""
    generated = not row.get("decode_error") and not row.get(INFERENCE_ERROR) and row.get("generated_text") is not None
    seconds = row.get("time_taken_llm")
    return {
        "num_generated_tokens": tokens,
        "num_input_tokens": int(row.get("num_input_tokens") or 0) if generated else 0,
        "finish_reason": ("length" if tokens >= max_tokens else "stop") if generated else "",
        "llm_seconds": float(seconds) if generated and seconds is not None and seconds >= 0 else 0.0,
    }


class FinalizeRows:
    """After the processor: rows the engine failed bypass postprocess inside Ray (they come out as
    the raw engine row with `__inference_error__`); give them the output columns too. Ray also
    bypasses postprocess for a row whose `__inference_error__` is null (not ""), which happens
    when a block mixes rows with and without the column; such a raw row (no `marker` column, which
    postprocess always sets) is postprocessed here. Shared with the vLLM labeller."""

    def __init__(self, postprocess: Callable[[Mapping[str, Any]], dict[str, Any]], columns: Sequence[str],
                 marker: str) -> None:
        self.postprocess, self.columns, self.marker = postprocess, tuple(columns), marker

    def __call__(self, row: Mapping[str, Any]) -> dict[str, Any]:
        if row.get(INFERENCE_ERROR) or row.get(self.marker) is None:
            return self.postprocess(row)
        return {name: row[name] for name in self.columns} | carried(row)


class Finalize(FinalizeRows):
    """FinalizeRows for caption rows."""

    def __init__(self, config: CaptionerConfig) -> None:
        super().__init__(Postprocess(config), OUTPUT_COLUMNS, "caption")


def build_vllm_processor(config: CaptionerConfig, fallback: bool = False) -> Any:
    """`ray.data.llm.build_processor` for captioning (a Processor: Dataset -> Dataset); `fallback`:
    with the fallback decoding."""
    from ray.data.llm import build_processor

    return build_processor(build_vllm_processor_config(config), preprocess=Preprocess(config, fallback),
                           postprocess=Postprocess(config))


def carried(row: Mapping[str, Any]) -> dict[str, Any]:
    return {name: row[name] for name in CARRIED if name in row}


def caption_dataset(dataset: Any, config: CaptionerConfig, carry: Sequence[str] = (), fallback: bool = False) -> Any:
    """Rows (content_id, image, original_caption) -> caption rows, through vLLM; the `carry`
    columns (of CARRIED) come out as they went in; `fallback`: with the fallback decoding."""
    processor = build_vllm_processor(config, fallback)
    return processor(dataset.select_columns(["content_id", "image", *carry])).map(Finalize(config))
