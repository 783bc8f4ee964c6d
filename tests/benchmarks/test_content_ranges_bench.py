"""The content-ranges benchmark at a small size: every unit's lookup finds exactly its keys (the
benchmark checks), and a unit whose keys are one content range reads fewer bytes than one of
random keys, cold, as Lance counts them. The figures at 1M-16M rows are in docs/benchmarks.md; no
time is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.content_ranges import PATTERNS, main


@pytest.mark.parametrize("keys", ["content", "caption"])
def test_a_range_of_keys_reads_less_than_random_keys(tmp_path: Path, keys: str) -> None:
    """Keyed by content (model captioners) or by the source captioner's caption keys, which sort by content."""
    out = tmp_path / "ranges.json"
    main(["--rows", "300000", "--sources", "4", "--units", "2", "--keys", keys, "--dir", str(tmp_path),
          "--json", str(out)])
    (size,) = json.loads(out.read_text())["sizes"]
    assert size["keys"] == keys
    got = size["lookups"]
    assert set(got) == set(PATTERNS) and all(got[p]["cold_mb"] > 0 for p in PATTERNS)
    assert got["random"]["cold_mb"] > 1.3 * got["range_keys"]["cold_mb"]  # the index: every page vs a few
    assert list(tmp_path.glob("content_ranges_*")) == []  # the table is removed
