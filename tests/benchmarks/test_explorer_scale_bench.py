"""The explorer's scale benchmark at a small size: tables generated once per size in the pipeline's
schemas (several fragments, every index), facets equal to the rows, every measured page answered,
and a second run measuring the cached tables without generating them again."""

from __future__ import annotations

import json
from pathlib import Path

import lance
import pyarrow.compute as pc
import pytest

from benchmarks import explorer_scale
from prx_core.store import schemas


def test_generated_tables_are_cached_counted_and_every_page_measured(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(explorer_scale, "FRAGMENT_ROWS", 4_000)
    out, cache = tmp_path / "scale.json", tmp_path / "cache"
    args = ["--rows", "20000", "--repeats", "2", "--cache", str(cache), "--json", str(out)]
    assert explorer_scale.main(args) == 0
    root = cache / "rows-20000" / "lance"
    rows = lance.dataset(str(root / "explorer.lance"))
    assert rows.schema == schemas.EXPLORER and rows.count_rows() == 20_000 and len(rows.get_fragments()) >= 5
    assert {"sample_id_btree", "source_bitmap", "label_bitmap", "search_text_fts"} <= {i.name for i in rows.describe_indices()}
    facets = lance.dataset(str(root / "explorer_facets.lance")).to_table().to_pylist()
    for source, size in explorer_scale.source_sizes(20_000):
        totals = {f["value"]: f["count"] for f in facets if f["source"] == source and f["facet"] == "totals"}
        assert totals["rows"] == size == rows.count_rows(f"source = '{source}'")
        assert totals["skipped"] == rows.count_rows(f"source = '{source}' AND skip_reason IS NOT NULL")
    report = json.loads(out.read_text())
    for page in ("home", "text_search", "filter_source_label", "detail"):
        assert 0 < report[page]["p50_ms"] <= report[page]["p95_ms"] and report[f"{page}_lance"]["p50_ms"] > 0, page
    assert report["rss_mb"] > 0 and report["generation"]["disk_gb"] > 0
    assert pc.sum(rows.to_table(columns=["stored"])["stored"]).as_py() < 20_000  # some ingest rejects

    version = rows.version
    monkeypatch.setattr(explorer_scale, "generate", lambda *a: pytest.fail("generated again"))
    assert explorer_scale.main(args) == 0
    assert lance.dataset(str(root / "explorer.lance")).version == version
