"""The index-segments benchmark at a small size: the bounded policy keeps the BTREE index within
its bound where a delta per catch-up leaves one segment per append, every lookup finds exactly the
keys' rows (the benchmark checks), and a cold 5-key lookup reads fewer bytes, as Lance counts
them. The measured figures at 1M-16M rows are in docs/benchmarks.md; no time is asserted."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.index_segments import main
from prx_core.store.segments import MAX_SEGMENTS


def test_bounded_segments_read_less_than_a_delta_per_catch_up(tmp_path: Path) -> None:
    out = tmp_path / "segments.json"
    main(["--rows", "200000", "--catch-ups", "40", "--repeats", "1", "--dir", str(tmp_path), "--json", str(out)])
    (size,) = json.loads(out.read_text())["sizes"]
    old, bounded = size["old"], size["bounded"]
    assert len(old["segments"]) == 40 and sum(old["segments"]) == 200_000
    assert bounded["most_segments"] <= MAX_SEGMENTS and sum(bounded["segments"]) == 200_000
    assert size["ratios"]["5_keys_cold"]["mb"] > 2  # 40 segments' pages vs a few
    assert all(entry["mb"] > 0 for entry in bounded["lookups"].values())
    assert list(tmp_path.glob("index_segments_*")) == []  # the tables are removed
