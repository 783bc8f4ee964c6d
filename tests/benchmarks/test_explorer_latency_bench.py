"""The explorer latency benchmark runs end to end at a small size (a smoke run, no timing assertion)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.explorer_data import PLANTED
from benchmarks.explorer_latency import CLASS_NAMES, format_table, main
from benchmarks.explorer_queries import index_use


def test_quick_run_reports_every_key(tmp_path: Path) -> None:
    out = tmp_path / "explorer.json"
    assert main(["--quick", "--rows", "20000", "--fragment-rows", "2000", "--json", str(out),
                 "--dir", str(tmp_path / "tables")]) == 0
    results = json.loads(out.read_text())
    assert results["pylance"] and results["cores"] >= 1
    (run,) = results["runs"]
    counts = list(PLANTED.values())  # the timed rare queries cycle through the planted words
    timed = range(results["warmups"], results["warmups"] + results["queries"])
    rare_mean = sum(counts[i % len(counts)] for i in timed) / len(timed)
    assert run["rows"] == run["table_rows"] == 20000
    assert run["fragments_before"] == 10
    assert run["fragments_after"] < run["fragments_before"]
    assert run["vector_index_type"] == "IVF_FLAT"  # below refresh_indexes' 100k-row IVF_PQ threshold
    for key in ("write_s", "fts_index_s", "vector_index_s", "index_build_s", "compact_s", "peak_rss_mb"):
        assert run[key] > 0, key
    for phase in ("before", "after"):
        assert 0 < run[f"fts_p50_ms_{phase}"] <= run[f"fts_p95_ms_{phase}"], phase
        assert 0 < run[f"nn_p50_ms_{phase}"] <= run[f"nn_p95_ms_{phase}"], phase
        for name in CLASS_NAMES:
            assert 0 < run[f"{name}_p50_ms_{phase}"] <= run[f"{name}_p95_ms_{phase}"], (name, phase)
            assert run[f"{name}_index_{phase}"] == "index", (name, phase)
            assert run[f"{name}_wrong_source_{phase}"] == 0, (name, phase)
        # every planted rare word is found in exactly its planted rows, through the index
        assert run[f"rare_hits_{phase}"] == PLANTED, phase
        assert run[f"rare_hits_ok_{phase}"] is True
        assert run[f"fts_rare_hits_mean_{phase}"] == rare_mean  # limit 50 >= every planted count
        assert run[f"fts_common_hits_mean_{phase}"] == 50
        assert run[f"nn_hits_mean_{phase}"] == 50
        # IVF_FLAT with 20 of ~141 partitions on clustered vectors: near-exact neighbours
        assert run[f"nn_recall_{phase}"] >= 0.9, phase
        assert run[f"nn_filtered_recall_{phase}"] >= 0.9, phase
        assert run[f"unindexed_fragments_{phase}"] == {"caption_fts": 0, "embedding_vector": 0}
    # the extra phase: the filtered classes again with a BITMAP index on `source`
    assert run["bitmap_index_s"] > 0
    for name in ("fts_filtered", "nn_filtered"):
        assert run[f"{name}_scalar_index_after"] is False and run[f"{name}_scalar_index_bitmap"] is True, name
        assert 0 < run[f"{name}_p50_ms_bitmap"] <= run[f"{name}_p95_ms_bitmap"], name
        assert run[f"{name}_wrong_source_bitmap"] == 0, name
    assert run["nn_filtered_recall_bitmap"] >= 0.9
    assert "fts_common_p50_ms_bitmap" not in run
    assert (tmp_path / "tables" / "explorer_20000.lance").is_dir()  # --dir keeps the table
    assert "fts_common" in format_table(results)


def test_index_use_reads_the_plan() -> None:
    indexed = "SortExec\n  ANNSubIndex: name=embedding_vector\n    ANNIvfPartition: uuid=x"
    mixed = indexed + "\n  LanceScan: uri=t, projection=[embedding], row_id=true"
    assert index_use(indexed, "nn") == "index"
    assert index_use(mixed, "nn") == "index+flat"
    assert index_use("KNNVectorDistance: metric=cosine\n  LanceScan: projection=[embedding]", "nn") == "flat"
    assert index_use("GlobalLimitExec\n  MatchQuery: column=caption, query=[photo]", "fts") == "index"
    assert index_use("UnionExec\n  MatchQuery: column=caption\n  FlatMatchQuery: column=caption", "fts") == "index+flat"
    assert index_use("FlatMatchQuery: column=caption, query=photo", "fts") == "flat"
