"""The benchmark's three paths do the same work (a smoke run, not a timing assertion)."""

from __future__ import annotations

import io

from PIL import Image

from benchmarks.image_path import build_corpus, floor_path, format_table, fused_path, naive_path, render_path, run
from prx_core.image.buckets import assign_bucket


def test_paths_produce_the_bucket() -> None:
    corpus = build_corpus(4, seed=3)
    assert all(0.2 <= s.megapixels <= 15.5 for s in corpus)
    for sample in corpus:
        size = Image.open(io.BytesIO(sample.data)).size
        bucket = assign_bucket(*size)
        assert Image.open(io.BytesIO(naive_path(sample.data, 4096))).size == bucket.size
        assert Image.open(io.BytesIO(fused_path(sample.data, 4096))).size == bucket.size
        assert render_path(sample.data, 4096) == fused_path(sample.data, 4096)
        floor = Image.open(io.BytesIO(floor_path(sample.data, 4096))).size
        assert floor[0] <= bucket.width and floor[1] <= bucket.height


def test_small_run_reports_every_key() -> None:
    results = run(images=6)
    for key in ("naive_ips", "fused_ips", "render_ips", "render_over_fused", "floor_ips", "fused_over_naive",
                "floor_over_fused", "fused_ips_max1024",
                "resize_ms_pillow_simd", "prx_phash_ips", "imagehash_ips", "peak_rss_mb_15mp"):
        assert results[key] and results[key] > 0, key
    assert results["peak_rss_mb_15mp"] < 4096
    for suffix in ("", "_max1024"):
        assert set(results[f"stage_ms{suffix}"]) == {"decode", "phash", "resize", "encode"}
        assert all(ms > 0 for ms in results[f"stage_ms{suffix}"].values())
        assert results[f"floor_over_naive{suffix}"] > 0
        assert set(results[f"reference_ms{suffix}"]) == {"naive", "fused", "render", "floor"}
    assert "floor / naive" in format_table(results)
    assert "fused / naive" in format_table(results)
