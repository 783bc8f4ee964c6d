"""Overhead of the `openai` captioner backend against direct calls to the same local model.

Both paths caption the same JPEGs with the tiny local Qwen2-VL (prx_core.models.tiny_vlm), on one core
with one torch thread, in the same process:

- direct: `TransformersCaptioner.caption_batch` (batches of `--batch` images)
- openai: `OpenAICaptioner` (concurrency `--batch`) -> HTTP on loopback -> `prx_core.models.serving`
  (micro-batches of up to `--batch`) -> the same `TransformersCaptioner`

- transport: the `openai` path against a server whose captioner answers a fixed string: the
  path's whole cost without any model

The difference per image is what the endpoint path adds on the CPU: decode + cap + JPEG re-encode
+ base64 + JSON on the client, HTTP both ways, base64 + JPEG decode again on the server. The tiny
model makes generation cheap, so the ratio here is a worst case; the ms/image is the number that
carries over to a real VLM (whose generation costs 50 ms to seconds per image). Rounds alternate
between the paths after a warm-up; each keeps its best round (load only slows a round down).

    python -m benchmarks.openai_overhead [--images 48] [--rounds 5] [--tokens 12] [--batch 8]
"""

from __future__ import annotations

import argparse
import io
import tempfile
import time
from pathlib import Path

import numpy as np
import skimage.data
from PIL import Image

from benchmarks.image_path import _cpu_name, one_core
from prx_core.models.caption_base import Captioner, CaptionerConfig, CaptionResult
from prx_core.models.captioning import build_captioner
from prx_core.models.captioning_openai import encode_for_request
from prx_core.models.captioning_transformers import TransformersCaptioner
from prx_core.models.serving import CaptionServer
from prx_core.models.tiny_vlm import build_tiny_qwen2_vl

PIXELS = 112 * 112  # the tiny checkpoint's processor cap


def corpus(count: int) -> list[bytes]:
    """`count` distinct JPEG q90 crops (0.1-0.5 MP) of the bundled scikit-image photos."""
    sources = [skimage.data.astronaut(), skimage.data.coffee(), skimage.data.chelsea(), skimage.data.rocket()]
    rng = np.random.default_rng(0)
    images = []
    for i in range(count):
        array = sources[i % len(sources)]
        h, w = array.shape[:2]
        ch, cw = int(h * rng.uniform(0.6, 1.0)), int(w * rng.uniform(0.6, 1.0))
        y, x = rng.integers(0, h - ch + 1), rng.integers(0, w - cw + 1)
        buffer = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(array[y : y + ch, x : x + cw])).save(buffer, format="JPEG", quality=90)
        images.append(buffer.getvalue())
    return images


class NullCaptioner(Captioner):
    """Answers a fixed caption without looking: the server side of a transport-only round."""

    def caption_batch(self, images, original_captions):
        return [CaptionResult("a fixed caption of eight words for timing") for _ in images]


def timed(fn) -> tuple[float, float, object]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, out


def run(images: int = 48, rounds: int = 5, tokens: int = 12, batch: int = 8) -> dict:
    import torch

    torch.set_num_threads(1)
    data = corpus(images)
    with tempfile.TemporaryDirectory() as tmp, one_core():
        checkpoint = build_tiny_qwen2_vl(Path(tmp) / "tiny-qwen2-vl", seed=0)
        local = TransformersCaptioner(CaptionerConfig(
            "transformers", model=str(checkpoint), max_new_tokens=tokens, max_pixels=PIXELS, batch_size=batch,
        ))
        with CaptionServer(local, "tiny", max_batch=batch) as server:
            client = build_captioner(CaptionerConfig(
                "openai", model="tiny", endpoint=server.url, max_new_tokens=tokens, max_pixels=PIXELS,
                concurrency=batch, timeout_s=600, max_retries=0,
            ))
            paths = {
                "direct": lambda: local.caption_batch(data, [None] * len(data)),
                "openai": lambda: client.caption_batch(data, [None] * len(data)),
            }
            for fn in paths.values():  # warm-up: allocator, tokenizer caches, connection setup
                fn()
            best = {name: (float("inf"), float("inf")) for name in paths}
            server.stats.batches.clear()
            for _ in range(rounds):
                for name, fn in paths.items():
                    wall, cpu, results = timed(fn)
                    assert all(r.caption for r in results), f"{name}: {[r.error for r in results if r.error][:3]}"
                    best[name] = (min(best[name][0], wall), min(best[name][1], cpu))
            server_batch = float(np.mean(server.stats.batches))
            encode_wall, _, _ = timed(lambda: [encode_for_request(d, PIXELS) for d in data])
            usage = dict(client.usage)
        null_config = CaptionerConfig("source")  # the null captioner reads nothing from its config
        with CaptionServer(NullCaptioner(null_config), "null", max_batch=batch) as null_server:
            transport = build_captioner(CaptionerConfig(
                "openai", model="null", endpoint=null_server.url, max_new_tokens=tokens, max_pixels=PIXELS,
                concurrency=batch, timeout_s=600, max_retries=0,
            ))
            transport.caption_batch(data, [None] * len(data))
            best["transport"] = min(timed(lambda: transport.caption_batch(data, [None] * len(data)))[:2] for _ in range(rounds))
    ms = {name: (wall * 1000 / images, cpu * 1000 / images) for name, (wall, cpu) in best.items()}
    return {
        "cpu": _cpu_name(), "images": images, "rounds": rounds, "max_new_tokens": tokens, "batch": batch,
        "direct_ms": ms["direct"][0], "openai_ms": ms["openai"][0],
        "direct_cpu_ms": ms["direct"][1], "openai_cpu_ms": ms["openai"][1],
        "overhead_ms": ms["openai"][0] - ms["direct"][0], "overhead_cpu_ms": ms["openai"][1] - ms["direct"][1],
        "ratio": ms["openai"][0] / ms["direct"][0], "client_encode_ms": encode_wall * 1000 / images,
        "server_mean_batch": server_batch, "transport_ms": ms["transport"][0], "transport_cpu_ms": ms["transport"][1],
        "completion_tokens_per_image": usage.get("completion_tokens", 0) / max(1, usage.get("ok", 0)),
    }


def report(r: dict) -> str:
    return "\n".join([
        f"{r['images']} JPEGs, tiny Qwen2-VL, max_new_tokens {r['max_new_tokens']}, batch/concurrency {r['batch']}, "
        f"best of {r['rounds']} rounds, one core ({r['cpu']})",
        "| path | ms/image (wall) | ms/image (process CPU) |",
        "|---|---|---|",
        f"| direct TransformersCaptioner | {r['direct_ms']:.1f} | {r['direct_cpu_ms']:.1f} |",
        f"| openai backend -> loopback server | {r['openai_ms']:.1f} | {r['openai_cpu_ms']:.1f} |",
        f"| openai backend -> loopback server, null model (transport only) | {r['transport_ms']:.2f} | {r['transport_cpu_ms']:.2f} |",
        f"overhead {r['overhead_ms']:+.1f} ms/image wall ({r['overhead_cpu_ms']:+.1f} CPU), ratio {r['ratio']:.2f}x; "
        f"client decode+cap+JPEG encode {r['client_encode_ms']:.2f} ms/image; "
        f"server mean micro-batch {r['server_mean_batch']:.1f}; "
        f"{r['completion_tokens_per_image']:.1f} completion tokens/image",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    print(report(run(args.images, args.rounds, args.tokens, args.batch)), flush=True)


if __name__ == "__main__":
    main()
