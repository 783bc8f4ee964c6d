"""How many captioning requests a vLLM engine holds at once, from the model and the GPU's memory.

vLLM runs as many sequences at once as its KV cache holds (`max_num_seqs` caps them), and Ray
Data keeps `batch_size` x `max_concurrent_batches` (8) requests in flight per engine. Too few and
the GPU idles between batches: the default batch of 8 gives an engine 64 requests, about a ninth
of what an H200 holds for Qwen3-VL-8B. The cache holds the GPU's memory x `gpu_memory_utilization`
less the weights and a reserve (activations, the vision encoder's work, CUDA graphs); one request
takes 2 (K and V) x layers x KV heads x head size x 2 bytes (bf16) for each of its tokens: the
image's (`max_pixels` / pixels per visual token), the prompt's and `max_new_tokens`. A bound, not
a measurement: outputs shorter than `max_new_tokens` leave room, which vLLM fills as it admits
more. Only known models and GPUs are sized; anything else keeps the config as given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from prx_core.models.caption_base import CaptionerConfig

PROMPT_TOKENS = 100  # the caption prompt and the chat template around it
RESERVE_GB = 8.0  # per GPU: activations, the vision encoder, CUDA graphs
UTILIZATION = 0.9  # vLLM's default gpu_memory_utilization
CONCURRENT_BATCHES = 8  # Ray Data's max_concurrent_batches per engine (its default)
HEADROOM = 1.25  # requests in flight per engine slot: the next batch is queued while one finishes


@dataclass(frozen=True)
class ModelShape:
    """What one token costs in the KV cache, what the weights take, and how many pixels one
    visual token covers (Qwen2/2.5-VL: 14 px patches merged 2 x 2; Qwen3-VL: 16 px patches)."""

    layers: int
    kv_heads: int
    head_dim: int
    weight_gb: float
    pixels_per_token: int

    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2


MODEL_SHAPES = {  # from each model's config.json (text_config), weights in bf16
    "Qwen/Qwen3-VL-8B-Instruct": ModelShape(layers=36, kv_heads=8, head_dim=128, weight_gb=17.5, pixels_per_token=32 * 32),
    "Qwen/Qwen2.5-VL-7B-Instruct": ModelShape(layers=28, kv_heads=4, head_dim=128, weight_gb=16.6,
                                              pixels_per_token=28 * 28),
}
GPU_MEMORY_GB = {"B200": 180.0, "H200": 141.0, "H100": 80.0, "A100-80G": 80.0, "L40S": 48.0, "A100-40G": 40.0}  # Ray's names


@dataclass(frozen=True)
class EngineSize:
    """One engine's sizing: sequences at once, the Ray Data batch that keeps it full, and why."""

    max_num_seqs: int
    batch_size: int
    tokens_per_request: int
    kv_gb_per_request: float
    cache_gb: float


def size_engine(shape: ModelShape, gpu_gb: float, *, max_pixels: int, max_new_tokens: int,
                tensor_parallel_size: int = 1, utilization: float = UTILIZATION) -> EngineSize:
    """The sizing of one engine replica over `tensor_parallel_size` GPUs of `gpu_gb` each."""
    tokens = math.ceil(max_pixels / shape.pixels_per_token) + PROMPT_TOKENS + max_new_tokens
    per_request = tokens * shape.kv_bytes_per_token() / 1e9
    cache = tensor_parallel_size * (gpu_gb * utilization - RESERVE_GB) - shape.weight_gb
    if cache <= per_request:
        raise ValueError(f"{shape} does not fit {tensor_parallel_size} x {gpu_gb:g} GB with room for one request")
    seqs = int(cache // per_request)
    return EngineSize(seqs, filling_batch(seqs), tokens, round(per_request, 4), round(cache, 1))


def filling_batch(max_num_seqs: int) -> int:
    """The Ray Data batch that keeps an engine of `max_num_seqs` full (CONCURRENT_BATCHES in flight)."""
    return math.ceil(max_num_seqs * HEADROOM / CONCURRENT_BATCHES)


def sized_engine(config: CaptionerConfig) -> EngineSize | None:
    """The sizing of the config's engine where its model and accelerator are known, else None."""
    shape, gpu = MODEL_SHAPES.get(config.model), GPU_MEMORY_GB.get((config.accelerator_type or "").upper())
    if not config.size_from_gpu or shape is None or gpu is None:
        return None
    utilization = float(config.engine_kwargs.get("gpu_memory_utilization", UTILIZATION))
    return size_engine(shape, gpu, max_pixels=config.max_pixels, max_new_tokens=config.max_new_tokens,
                       tensor_parallel_size=config.tensor_parallel_size, utilization=utilization)


def sized_settings(config: CaptionerConfig) -> tuple[int, dict[str, Any]]:
    """The batch size the processor gets and the engine arguments sizing adds (`max_num_seqs`;
    the config's engine_kwargs override it): sized where known, the batch at least the config's."""
    size = sized_engine(config)
    if size is None:
        return config.batch_size, {}
    seqs = int(config.engine_kwargs.get("max_num_seqs", size.max_num_seqs))
    return max(config.batch_size, filling_batch(seqs)), {"max_num_seqs": size.max_num_seqs}


def describe_sizing(config: CaptionerConfig) -> str:
    """One line for `prx-corpus plan`: how the config's vLLM engines will be sized, or why not."""
    size = sized_engine(config)
    if size is not None:
        batch, _ = sized_settings(config)
        seqs = config.engine_kwargs.get("max_num_seqs", size.max_num_seqs)
        return (f"vLLM engines of {config.model} on {config.accelerator_type} x {config.tensor_parallel_size}: "
                f"{seqs} requests at once ({size.tokens_per_request:,}-token requests, "
                f"{size.kv_gb_per_request:.2f} GB of KV cache each, {size.cache_gb:g} GB of cache), batches of {batch}")
    if not config.size_from_gpu:
        why = "size_from_gpu: false"
    elif config.model not in MODEL_SHAPES:
        why = f"no known shape for {config.model}"
    else:
        why = f"no known memory for accelerator_type {config.accelerator_type!r}"
    return f"vLLM engines: batch_size {config.batch_size} and engine_kwargs as configured ({why}; docs/captioning.md)"
