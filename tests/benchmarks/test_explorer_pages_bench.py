"""The explorer page benchmark runs end to end at a small size: every page answers 200 over
tables in the pipeline's schemas, and the report has each page and its Lance floor."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.explorer_pages import main


def test_explorer_pages_benchmark_reports_every_page(tmp_path: Path) -> None:
    out = tmp_path / "pages.json"
    assert main(["--rows", "2000", "--repeats", "3", "--json", str(out)]) == 0
    report = json.loads(out.read_text())["2000"]
    pages = ["browse", "browse_page_50", "filters", "text_search", "text_search_filtered", "more_like_this", "detail",
             "meta_filter"]
    for page in pages:
        assert 0 < report[page]["p50_ms"] <= report[page]["p95_ms"], page
    for page in ("text_search", "text_search_filtered", "more_like_this", "meta_filter"):
        assert report[f"{page}_over_lance"] > 0 and report[f"{page}_lance"]["p50_ms"] > 0
    assert report["open_s"] > 0
