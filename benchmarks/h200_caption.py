"""Captioning and text latents on one GPU with transformers: a randomly initialised model with
Qwen3-VL-8B-Instruct's published architecture, through the pipeline's own code paths.

Made for a machine with no network and only torch, transformers and pillow (issue 25): no weights,
no tokenizer files, no image data. Random weights cost the same FLOPs as trained ones, so:

- captioning: `TransformersCaptioner.caption_batch` (decode, pixel cap, chat template, batched
  `generate`) at each `--batch-sizes`, generation forced to exactly `--new-tokens` tokens (EOS
  suppressed until then: a real caption of the prompt's 100-200 words is ~200 tokens);
- text latents: `prx_core.models.text_latents.encode_captions` (PRX's text tower: the caption
  padded to 256 tokens, the text backbone's last hidden state in bfloat16) at each batch size.

The tokenizer is a byte-level BPE trained on the fly (`prx_core.models.tiny_vlm`), so prompt and
caption token counts are close to, not equal to, Qwen's; the image token count is exact (the
Qwen3-VL image processor: 16 px patches merged 2x2). `--tiny` swaps in a two-layer config of the
same family so the script runs on a CPU in seconds (tests/benchmarks/test_h200_caption_bench.py).

    python -m benchmarks.h200_caption --out $OUT/h200.json            # on the H200
    python -m benchmarks.h200_caption --tiny --batch-sizes 2 --images 4 --new-tokens 8

Prints one line per measurement and writes everything as JSON (`--out`): images/s, generated
tokens/s, latents/s, peak GPU memory (torch's allocator) and GPU utilisation (nvidia-smi, sampled
every 0.2 s, when present).
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import subprocess
import threading
import time
from typing import Any

from PIL import Image

# Qwen/Qwen3-VL-8B-Instruct's config.json (the published architecture, 8.77B parameters).
QWEN3_VL_8B: dict[str, Any] = {
    "text_config": {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                    "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 5_000_000,
                    "max_position_embeddings": 262144, "attention_bias": False, "tie_word_embeddings": False,
                    "rope_scaling": {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True}},
    "vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "in_channels": 3,
                      "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 4096,
                      "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24],
                      "hidden_act": "gelu_pytorch_tanh"},
    "tie_word_embeddings": False,
}
TINY: dict[str, Any] = {
    "text_config": {**QWEN3_VL_8B["text_config"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512,
                    "rope_scaling": {"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True}},
    "vision_config": {**QWEN3_VL_8B["vision_config"], "depth": 2, "hidden_size": 32, "intermediate_size": 64,
                      "num_heads": 2, "out_hidden_size": 64, "num_position_embeddings": 64, "deepstack_visual_indexes": [0]},
    "tie_word_embeddings": False,
}
LATENT_TOKENS = 256


def build(tiny: bool, device: str, max_pixels: int) -> tuple[Any, Any]:
    """(model, processor): the architecture with random weights (bf16 on a GPU), our tokenizer."""
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor

    from prx_core.models.tiny_vlm import CHAT_TEMPLATE, SPECIAL_TOKENS, train_tokenizer

    tokenizer = train_tokenizer()
    size = {"shortest_edge": 32 * 32, "longest_edge": max_pixels}
    processor = Qwen3VLProcessor(image_processor=image_processor(size),
                                 video_processor=video_processor(size),
                                 tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    spec = TINY if tiny else QWEN3_VL_8B
    text = {**spec["text_config"], "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"],
            "bos_token_id": None}
    config = Qwen3VLConfig(text_config=text, vision_config=spec["vision_config"],
                           tie_word_embeddings=spec["tie_word_embeddings"], image_token_id=ids["<|image_pad|>"],
                           video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                           vision_end_token_id=ids["<|vision_end|>"])
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            model = Qwen3VLForConditionalGeneration(config).eval()
    finally:
        torch.set_default_dtype(previous)
    return model, processor


def image_processor(size: dict[str, int]) -> Any:
    """Qwen3-VL's image processor (16 px patches, 2x2 merge): the torchvision one where torchvision
    is installed, else the PIL one (transformers 5: `...Pil`; 4.x: the slow class)."""
    import importlib.util

    import transformers

    if importlib.util.find_spec("torchvision") is not None:
        cls = transformers.Qwen2VLImageProcessorFast if hasattr(transformers, "Qwen2VLImageProcessorFast") \
            else transformers.Qwen2VLImageProcessor
    else:
        cls = getattr(transformers, "Qwen2VLImageProcessorPil", None) or transformers.Qwen2VLImageProcessor
    return cls(size=dict(size), patch_size=16, merge_size=2)


def video_processor(size: dict[str, int]) -> Any:
    """Never used (no video), but the processor requires one, and transformers 5's Qwen3-VL video
    processor needs torchvision: without it, a stand-in with the same patch geometry."""
    import importlib.util

    import transformers
    from transformers.processing_utils import ProcessorMixin

    if importlib.util.find_spec("torchvision") is not None or transformers.__version__.split(".")[0] < "5":
        return transformers.Qwen3VLVideoProcessor(size=dict(size), patch_size=16, merge_size=2)

    class NoVideo(ProcessorMixin.get_possibly_dynamic_module("BaseVideoProcessor")):  # the class it checks for
        def __init__(self) -> None:
            self.patch_size, self.merge_size, self.temporal_patch_size = 16, 2, 2

    return NoVideo()


def count_parameters(tiny: bool = False) -> int:
    """Parameters of the architecture, built on the meta device (no memory): 8.77B for the 8B."""
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    spec = TINY if tiny else QWEN3_VL_8B
    config = Qwen3VLConfig(text_config=spec["text_config"], vision_config=spec["vision_config"],
                           tie_word_embeddings=spec["tie_word_embeddings"])
    with torch.device("meta"):
        return sum(p.numel() for p in Qwen3VLForConditionalGeneration(config).parameters())


def images(n: int, size: tuple[int, int] = (1024, 768)) -> list[bytes]:
    """Distinct JPEGs (gradients and bands: no dataset on the machine); the pixel cap resizes them."""
    out = []
    for i in range(n):
        image = Image.linear_gradient("L").resize(size).convert("RGB")
        bands = Image.new("RGB", size, ((37 * i) % 256, (91 * i) % 256, (151 * i) % 256))
        buffer = io.BytesIO()
        Image.blend(image, bands, 0.3 + 0.4 * (i % 5) / 5).rotate(i * 7).save(buffer, "JPEG", quality=90)
        out.append(buffer.getvalue())
    return out


class Utilisation:
    """nvidia-smi's GPU utilisation sampled every 0.2 s while measuring (none without nvidia-smi)."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=5).stdout
                self.samples.append(float(out.split()[0]))
            except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                return

    def __enter__(self) -> Utilisation:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(2)

    @property
    def mean(self) -> float | None:
        return round(sum(self.samples) / len(self.samples), 1) if self.samples else None


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure_captions(model: Any, processor: Any, data: list[bytes], batch: int, new_tokens: int,
                     max_pixels: int) -> dict[str, Any]:
    import torch

    from prx_core.models.caption_base import CaptionerConfig
    from prx_core.models.captioning_transformers import TransformersCaptioner

    config = CaptionerConfig(backend="transformers", model="(random weights)", max_new_tokens=new_tokens,
                             max_pixels=max_pixels, batch_size=batch)
    captioner = TransformersCaptioner(config, model=model, processor=processor)
    captioner.generation_config.min_new_tokens = new_tokens  # a fixed length: EOS cannot end it early
    captioner.caption_batch(data[:batch], [None] * batch)  # warm-up: kernels, allocator
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    _sync()
    with Utilisation() as gpu:
        started = time.perf_counter()
        results = captioner.caption_batch(data, [None] * len(data))
        _sync()
        seconds = time.perf_counter() - started
    tokens = sum(r.tokens or 0 for r in results)
    return {"batch_size": batch, "images": len(data), "seconds": round(seconds, 2),
            "images_per_s": round(len(data) / seconds, 2), "tokens_per_s": round(tokens / seconds, 1),
            "tokens": tokens, "failed": sum(r.error is not None for r in results), "gpu_util_mean": gpu.mean,
            "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None}


def measure_latents(model: Any, tokenizer: Any, batch: int, rounds: int) -> dict[str, Any]:
    import torch

    from prx_core.models.text_latents import encode_captions

    words = "a wooden table stands in the centre of a bright room with a red chair on the left ".split()
    captions = [" ".join(words[(i + k) % len(words)] for k in range(150)) for i in range(batch)]  # ~200 tokens
    latents, mask = encode_captions(model, tokenizer, captions, LATENT_TOKENS)  # warm-up
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    _sync()
    with Utilisation() as gpu:
        started = time.perf_counter()
        for _ in range(rounds):
            latents, mask = encode_captions(model, tokenizer, captions, LATENT_TOKENS)
        _sync()
        seconds = time.perf_counter() - started
    return {"batch_size": batch, "latents": batch * rounds, "seconds": round(seconds, 2),
            "latents_per_s": round(batch * rounds / seconds, 1), "shape": list(latents.shape),
            "dtype": str(latents.dtype), "mean_tokens": round(float(mask.sum(dim=1).float().mean()), 1),
            "gpu_util_mean": gpu.mean,
            "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None}


def run(tiny: bool, batch_sizes: list[int], n_images: int, new_tokens: int, max_pixels: int,
        latent_batches: list[int], latent_rounds: int, log=print) -> dict[str, Any]:
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    started = time.perf_counter()
    model, processor = build(tiny, device, max_pixels)
    report: dict[str, Any] = {
        "model": "tiny Qwen3-VL (2 layers)" if tiny else "Qwen3-VL-8B-Instruct architecture, random weights",
        "parameters": sum(p.numel() for p in model.parameters()), "device": device,
        "gpu": torch.cuda.get_device_name() if device == "cuda" else f"CPU ({platform.machine()})",
        "torch": torch.__version__, "transformers": transformers.__version__, "dtype": str(next(model.parameters()).dtype),
        "build_s": round(time.perf_counter() - started, 1), "new_tokens": new_tokens, "max_pixels": max_pixels,
        "captions": [], "latents": []}
    log(f"{report['model']}: {report['parameters'] / 1e6:,.1f}M parameters on {report['gpu']}, "
        f"transformers {report['transformers']}, built in {report['build_s']} s")
    data = images(n_images)
    for batch in batch_sizes:
        row = measure_captions(model, processor, data[:max(batch, n_images // batch * batch)], batch, new_tokens,
                               max_pixels)
        report["captions"].append(row)
        log(f"captions batch {batch}: {row['images_per_s']} images/s, {row['tokens_per_s']} tokens/s, "
            f"peak {row['peak_gpu_gib']} GiB, util {row['gpu_util_mean']}%")
    for batch in latent_batches:
        row = measure_latents(model, processor.tokenizer, batch, latent_rounds)
        report["latents"].append(row)
        log(f"latents batch {batch}: {row['latents_per_s']} latents/s {row['shape']} {row['dtype']}, "
            f"peak {row['peak_gpu_gib']} GiB, util {row['gpu_util_mean']}%")
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a two-layer config of the same family (CPU, tests)")
    parser.add_argument("--batch-sizes", default="16,32,64", help="captioning batch sizes (default 16,32,64)")
    parser.add_argument("--images", type=int, default=128, help="images captioned per batch size (default 128)")
    parser.add_argument("--new-tokens", type=int, default=200, help="tokens generated per caption (default 200)")
    parser.add_argument("--max-pixels", type=int, default=448 * 448, help="pixel cap (default: the captioner's)")
    parser.add_argument("--latent-batches", default="64,256", help="text-latent batch sizes (default 64,256)")
    parser.add_argument("--latent-rounds", type=int, default=8, help="batches encoded per size (default 8)")
    parser.add_argument("--out", help="write the report as JSON here")
    args = parser.parse_args(argv)
    report = run(args.tiny, [int(b) for b in args.batch_sizes.split(",")], args.images, args.new_tokens,
                 args.max_pixels, [int(b) for b in args.latent_batches.split(",")], args.latent_rounds)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=2)
    return report


if __name__ == "__main__":
    main()
