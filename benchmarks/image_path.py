"""Image-path benchmark: the naive path a user would write vs `process_image` vs the floor.

All four run in this process, on one core, over the same corpus of real-photo JPEGs (0.2 to
15 megapixels, derived from the offline photos), so the ratios compare like with like:

- naive: open, convert, pHash of the full image (imagehash), decode again, crop, Lanczos, q92
- fused: `prx_core.image.imaging.process_image` (one decode, DCT-scaled where it pays)
- render: `process_image(facts=False)`, what `mds_shards` runs (ingest stored the pHash and quality)
- floor: decode at the same DCT scale, cut the bucket's pixels out without resampling, q92
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps

from prx_core.demo.photos import find_wallpapers, load_skimage_photos
from prx_core.image.buckets import TIERS, Bucket, assign_bucket, crop_box
from prx_core.image.decode import decode_opened, open_image
from prx_core.image.imaging import Processed, draft_target, encode_jpeg, process_image, resize_to_bucket
from prx_core.image.phash import phash

ASPECTS = (0.67, 0.75, 1.0, 1.33, 1.5, 1.78)


@dataclass(frozen=True)
class Sample:
    data: bytes
    megapixels: float


def load_bench_photos(limit: int = 12) -> list[Image.Image]:
    """Full-resolution wallpapers when installed (up to 5120x2880), else scikit-image's photos."""
    photos = []
    for path in find_wallpapers()[:limit]:
        try:
            with Image.open(path) as im:
                photos.append(im.convert("RGB"))
        except OSError:
            continue
    photos += [p.image.convert("RGB") for p in load_skimage_photos() if p.image.mode == "RGB"]
    return photos


def build_corpus(count: int, seed: int = 7) -> list[Sample]:
    """`count` JPEGs with sizes log-uniform in 0.2..15 MP, crops of real photos."""
    rng = np.random.default_rng(seed)
    photos = load_bench_photos()
    corpus = []
    for i in range(count):
        photo = photos[i % len(photos)]
        aspect = float(ASPECTS[int(rng.integers(len(ASPECTS)))])
        megapixels = float(np.exp(rng.uniform(np.log(0.2), np.log(15.0))))
        h = int(round((megapixels * 1e6 / aspect) ** 0.5))
        w = int(round(h * aspect))
        cw, ch = (photo.width, int(photo.width / aspect)) if photo.width / photo.height < aspect else (int(photo.height * aspect), photo.height)
        image = photo.crop((0, 0, cw, ch)).resize((w, h), Image.Resampling.LANCZOS)
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", quality=int(rng.integers(80, 96)))
        corpus.append(Sample(buffer.getvalue(), w * h / 1e6))
    return corpus


def naive_path(data: bytes, max_tier: int) -> bytes:
    import imagehash

    image = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
    imagehash.phash(image)
    image = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
    bucket = assign_bucket(*image.size, max_tier=max_tier)
    resized = image.crop(crop_box(*image.size, bucket)).resize(bucket.size, Image.Resampling.LANCZOS)
    return encode_jpeg(resized)


def floor_path(data: bytes, max_tier: int) -> bytes:
    image = Image.open(io.BytesIO(data))
    bucket: Bucket = assign_bucket(*image.size, max_tier=max_tier)
    image.draft(None, draft_target(image.size, bucket))
    image = image.convert("RGB")
    w, h = min(bucket.width, image.width), min(bucket.height, image.height)
    return encode_jpeg(image.crop((0, 0, w, h)))


def fused_path(data: bytes, max_tier: int) -> bytes:
    result = process_image(data, max_tier=max_tier)
    assert isinstance(result, Processed), result
    return result.jpeg


def render_path(data: bytes, max_tier: int) -> bytes:
    """mds_shards' path: `process_image` without the pHash and quality that ingest stored."""
    result = process_image(data, max_tier=max_tier, facts=False)
    assert isinstance(result, Processed), result
    return result.jpeg


def time_path(fn: Callable[[bytes, int], bytes], corpus: list[Sample], max_tier: int) -> dict[str, float]:
    start = time.perf_counter()
    for sample in corpus:
        fn(sample.data, max_tier)
    seconds = time.perf_counter() - start
    return {"ips": len(corpus) / seconds, "mps": sum(s.megapixels for s in corpus) / seconds, "seconds": seconds}


REFERENCE_SIZE = (2560, 1600)  # the photos the reference costs were measured on


def reference_corpus(count: int = 12) -> list[Sample]:
    """Wallpapers (or scikit-image photos) resized to exactly 2560x1600, JPEG q90."""
    corpus = []
    for photo in load_bench_photos()[:count]:
        buffer = io.BytesIO()
        photo.resize(REFERENCE_SIZE, Image.Resampling.LANCZOS).save(buffer, "JPEG", quality=90)
        corpus.append(Sample(buffer.getvalue(), REFERENCE_SIZE[0] * REFERENCE_SIZE[1] / 1e6))
    return corpus


def stage_ms(corpus: list[Sample], max_tier: int) -> dict[str, float]:
    """ms per image of each stage of `process_image`, timed one by one on the same corpus.

    decode + encode is the floor's work; pHash + resize is all that fused adds to it, so these
    four numbers bound both ratios: fused/naive <= floor/naive, floor/fused >= (d+e)/(d+e+p+r).
    """
    totals = dict.fromkeys(("decode", "phash", "resize", "encode"), 0.0)

    def timed(stage: str, fn: Callable[[], object]) -> object:
        start = time.perf_counter()
        value = fn()
        totals[stage] += time.perf_counter() - start
        return value

    for sample in corpus:
        opened = open_image(sample.data)
        bucket = assign_bucket(*opened.size, max_tier=max_tier)
        decoded = timed("decode", lambda: decode_opened(opened, min_size=draft_target(opened.size, bucket)))
        timed("phash", lambda: phash(decoded.image))
        resized = timed("resize", lambda: resize_to_bucket(decoded.image, bucket))
        timed("encode", lambda: encode_jpeg(resized))
    return {stage: seconds / len(corpus) * 1000 for stage, seconds in totals.items()}


def resize_ms(repeat: int = 5) -> float:
    """ms per Lanczos 2048x1536 -> 512x384 (the design's reference measurement), in this interpreter."""
    image = Image.effect_noise((2048, 1536), 64).convert("RGB")
    start = time.perf_counter()
    for _ in range(repeat):
        image.resize((512, 384), Image.Resampling.LANCZOS)
    return (time.perf_counter() - start) / repeat * 1000


STOCK_PILLOW_DIR = os.path.join(sys.prefix, "prx-stock-pillow")


def stock_pillow_resize_ms() -> float | None:
    """The same resize with stock Pillow, installed beside the venv (not into it) on first use."""
    if not os.path.isdir(os.path.join(STOCK_PILLOW_DIR, "PIL")):
        install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", STOCK_PILLOW_DIR, "pillow==13.0.0"]
        if subprocess.run(install, capture_output=True).returncode != 0:
            return None
    code = "import benchmarks.image_path as b; print(b.resize_ms())"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([STOCK_PILLOW_DIR, os.getcwd()])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=_repo_root())
    return float(out.stdout.strip()) if out.returncode == 0 else None


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def phash_throughput(images: list[Image.Image]) -> dict[str, float]:
    import imagehash

    from prx_core.image.phash import phash

    rates = {}
    for name, fn in (("prx_phash_ips", phash), ("imagehash_ips", imagehash.phash)):
        start = time.perf_counter()
        for image in images:
            fn(image)
        rates[name] = len(images) / (time.perf_counter() - start)
    return rates


def peak_rss_mb(megapixels: float = 15.0) -> float:
    """Peak RSS of a fresh process that runs `process_image` on one 15-megapixel JPEG."""
    code = (
        "import io, resource, sys\n"
        "from PIL import Image\n"
        "from prx_core.image.imaging import process_image\n"
        f"w = int(({megapixels} * 1e6 * 16 / 9) ** 0.5); h = int(w * 9 / 16)\n"
        "buf = io.BytesIO(); Image.linear_gradient('L').resize((w, h)).convert('RGB').save(buf, 'JPEG', quality=90)\n"
        "data = buf.getvalue(); del buf\n"
        "result = process_image(data)\n"
        "assert result.bucket.tier == 4096, result\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=_repo_root(), check=True)
    return float(out.stdout.strip().splitlines()[-1])


@contextmanager
def one_core() -> Iterator[None]:
    """Pin this process to one core for the measurement, and give the others back after."""
    if not hasattr(os, "sched_setaffinity"):
        yield
        return
    cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cores)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, cores)


def run(quick: bool = True, max_tiers: tuple[int, ...] = (TIERS[-1], 1024), images: int | None = None) -> dict:
    """The whole benchmark; returns a flat dict (JSON keys `naive_ips`, `fused_ips`, `floor_ips`, ...)."""
    with one_core():
        return _run(quick, max_tiers, images)


def _run(quick: bool, max_tiers: tuple[int, ...], images: int | None) -> dict:
    corpus = build_corpus(images or (200 if quick else 400))
    reference = reference_corpus(4 if images else 12)
    paths = (("naive", naive_path), ("fused", fused_path), ("render", render_path), ("floor", floor_path))
    results: dict = {
        "images": len(corpus),
        "corpus_megapixels_mean": float(np.mean([s.megapixels for s in corpus])),
        "corpus_megapixels_range": [min(s.megapixels for s in corpus), max(s.megapixels for s in corpus)],
        "python": sys.version.split()[0],
        "cpu": _cpu_name(),
    }
    for max_tier in max_tiers:
        suffix = "" if max_tier == TIERS[-1] else f"_max{max_tier}"
        for name, fn in paths:
            timing = time_path(fn, corpus, max_tier)
            results[f"{name}_ips{suffix}"] = timing["ips"]
            results[f"{name}_mps{suffix}"] = timing["mps"]
        results[f"fused_over_naive{suffix}"] = results[f"fused_ips{suffix}"] / results[f"naive_ips{suffix}"]
        results[f"floor_over_fused{suffix}"] = results[f"floor_ips{suffix}"] / results[f"fused_ips{suffix}"]
        results[f"floor_over_naive{suffix}"] = results[f"floor_ips{suffix}"] / results[f"naive_ips{suffix}"]
        results[f"render_over_fused{suffix}"] = results[f"render_ips{suffix}"] / results[f"fused_ips{suffix}"]
        results[f"stage_ms{suffix}"] = stage_ms(corpus[: len(corpus) // 2], max_tier)
        results[f"reference_ms{suffix}"] = {
            name: 1000 / time_path(fn, reference, max_tier)["ips"] for name, fn in paths
        }
    results["resize_ms_pillow_simd"] = resize_ms()
    results["resize_ms_stock_pillow"] = stock_pillow_resize_ms()
    if results["resize_ms_stock_pillow"]:
        results["resize_speedup_simd"] = results["resize_ms_stock_pillow"] / results["resize_ms_pillow_simd"]
    sample_images = [Image.open(io.BytesIO(s.data)).convert("RGB") for s in corpus[:40] if s.megapixels < 4]
    results.update(phash_throughput(sample_images))
    results["phash_speedup"] = results["prx_phash_ips"] / results["imagehash_ips"]
    from prx_core.image.phash import measure_exact_match

    results["phash_exact_match"] = measure_exact_match(sample_images[:24])
    results["peak_rss_mb_15mp"] = peak_rss_mb()
    return results


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def format_table(r: dict) -> str:
    rows = ["| path | images/s | MP/s |", "|---|---|---|"]
    for name in ("naive", "fused", "render", "floor"):
        rows.append(f"| {name} | {r[f'{name}_ips']:.1f} | {r[f'{name}_mps']:.1f} |")
    lines = [
        f"{r['images']} JPEGs, {r['corpus_megapixels_range'][0]:.1f}-{r['corpus_megapixels_range'][1]:.1f} MP "
        f"(mean {r['corpus_megapixels_mean']:.1f}), one core of {r['cpu']}",
        "",
        *rows,
        "",
        f"- fused / naive: {r['fused_over_naive']:.2f}x (target >= 3.5x); floor / fused: {r['floor_over_fused']:.2f} (target <= 1.25)",
        f"- render (mds_shards: fused without pHash and quality) / fused: {r['render_over_fused']:.2f}x",
    ]
    if "fused_ips_max1024" in r:
        lines.append(
            f"- corpus capped at tier 1024 (draft pays off): naive {r['naive_ips_max1024']:.1f}, fused "
            f"{r['fused_ips_max1024']:.1f}, floor {r['floor_ips_max1024']:.1f} images/s; fused / naive "
            f"{r['fused_over_naive_max1024']:.2f}x, floor / fused {r['floor_over_fused_max1024']:.2f}"
        )
    for suffix, regime in (("", "every tier"), ("_max1024", "capped at 1024")):
        if f"stage_ms{suffix}" in r:
            lines.append(_bounds_line(r, suffix, regime))
            ms = r[f"reference_ms{suffix}"]
            lines.append(
                f"- {REFERENCE_SIZE[0]}x{REFERENCE_SIZE[1]} photos, {regime}: naive {ms['naive']:.1f}, fused "
                f"{ms['fused']:.1f}, floor {ms['floor']:.1f} ms per image; fused / naive {ms['naive'] / ms['fused']:.2f}x, "
                f"floor / fused {ms['fused'] / ms['floor']:.2f}"
            )
    stock = r.get("resize_ms_stock_pillow")
    lines.append(
        f"- Lanczos 2048x1536 -> 512x384: pillow-simd {r['resize_ms_pillow_simd']:.1f} ms"
        + (f", stock Pillow {stock:.1f} ms ({r['resize_speedup_simd']:.1f}x)" if stock else ", stock Pillow unavailable")
    )
    lines.append(
        f"- pHash: {r['prx_phash_ips']:.0f} images/s vs imagehash {r['imagehash_ips']:.0f} images/s ({r['phash_speedup']:.1f}x)"
    )
    em = r["phash_exact_match"]
    lines.append("- pHash exact-match (distance 0): " + ", ".join(f"{k} {v:.2f}" for k, v in em.items()))
    lines.append(f"- peak RSS, process_image on a 15 MP JPEG: {r['peak_rss_mb_15mp']:.0f} MB (target < 1024)")
    return "\n".join(lines)


def _bounds_line(r: dict, suffix: str, regime: str) -> str:
    """What the stage costs allow: the targets are reachable only if these bounds are."""
    ms = r[f"stage_ms{suffix}"]
    floor_work, added = ms["decode"] + ms["encode"], ms["phash"] + ms["resize"]
    return (
        f"- per image, {regime}: decode {ms['decode']:.1f}, pHash {ms['phash']:.1f}, resize {ms['resize']:.1f}, "
        f"encode {ms['encode']:.1f} ms; pHash + resize = {added / floor_work:.2f} of decode + encode "
        f"(1.25 needs <= 0.25); a free resize and pHash would still give fused / naive <= "
        f"floor / naive = {r[f'floor_over_naive{suffix}']:.2f}x"
    )
