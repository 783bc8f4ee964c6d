"""A failing blocking check stops what depends on it in the same run."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
from conftest import checks_of, fresh_instance, image_folder_source, materialize, materialized, read

from prx_assets.automation import PER_SOURCE
from prx_assets.definitions import build_resources
from prx_assets.settings import Settings
from prx_core.sources.catalog import load_catalog


def test_missing_captions_fail_coverage_and_block_mds_shards(ray_session, tmp_path: Path) -> None:
    catalog_path = image_folder_source(tmp_path / "src", "no_captions", count=3, captions=False)
    resources = build_resources(Settings(root=str(tmp_path / "corpus"), sources=str(catalog_path)))
    instance = fresh_instance(load_catalog(catalog_path))
    result = materialize(resources, PER_SOURCE, "no_captions", instance)

    done = materialized(result)
    assert {"raw_source", "samples", "buckets", "phashes", "captions"} <= done.keys()
    assert done["buckets"]["bucketed"] == 3
    assert done["captions"]["failed"] == 3 and done["captions"]["captioned"] == 0
    assert "no_source_caption" in done["captions"]["failures"]
    coverage = checks_of(result)["captions_coverage"]
    assert not coverage.passed and coverage.metadata["missing"].value == 3
    assert coverage.severity == dg.AssetCheckSeverity.ERROR
    # blocked: nothing downstream of captions ran
    assert "mds_shards" not in done and "caption_labels" not in done and "caption_embeddings" not in done
    assert not (tmp_path / "corpus" / "mds").exists()
    assert not result.success
    # the failed captions are stored with their error (retried on the next run), not as captions
    rows = read(tmp_path / "corpus", "captions").to_pylist()
    assert len(rows) == 3 and all(r["caption"] == "" and r["error"].startswith("no_source_caption") for r in rows)
