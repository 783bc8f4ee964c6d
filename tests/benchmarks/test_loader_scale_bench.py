"""The loader-at-scale benchmark on a tiny tier: its synthetic tier is what the loader reads, and
the simulated node runs every rank and worker (a smoke run, not a timing assertion)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.loader_scale import TIER, format_table, run, shard_sizes, stream_layout
from prx_core.shards.manifest import load_manifest


def test_a_small_tier_is_generated_read_and_measured(tmp_path: Path) -> None:
    results = run(str(tmp_path), samples=200_000, streams=30, shards=300, ranks=2, workers=2, lookups=500,
                  log=lambda line: None)
    root = next(tmp_path.glob("tier-*"))
    spec = json.loads((root / "generated.json").read_text())["spec"]
    layout = stream_layout(spec)
    manifest = load_manifest(str(root), TIER)
    plans = manifest.plans()
    assert len(plans) == 30 and sum(p.count for p in plans) == 200_000 == sum(c for _, _, _, c, _ in layout)
    assert sum(s for *_, s in layout) == sum(len(json.loads((Path(p.uri) / "index.json").read_text())["shards"])
                                             for p in plans)
    assert all(len(p.skipped) == int(p.count * 0.05) for p in plans)
    assert sum(shard_sizes(1001, 7)) == 1001 and max(shard_sizes(1001, 7)) - min(shard_sizes(1001, 7)) <= 1
    for name in ("baseline", "loader"):
        assert results[name]["processes"] == 2 * (2 + 1) and results[name]["pss_mb"] > 0
    assert set(results["loader"]) >= {"load_s", "plans_s", "check_s", "substitutes_s"}
    again = run(str(tmp_path), samples=200_000, streams=30, shards=300, ranks=1, workers=1, lookups=10,
                log=lambda line: None)
    assert again["generated"] == results["generated"]  # cached: generated once
    assert "loader per node" in format_table(results)
