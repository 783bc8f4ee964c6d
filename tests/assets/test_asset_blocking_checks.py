"""A failing blocking check stops what depends on it in the same run."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
from demo_corpus import image_folder_source, read
from materializing import checks_of, fresh_instance, materialize, materialized

from prx_assets.automation import PER_SOURCE
from prx_assets.definitions import build_resources
from prx_assets.settings import Settings
from prx_core.models.caption_base import CaptionerConfig
from prx_core.models.captioning import SourceCaptioner
from prx_core.models.serving import CaptionServer, Faults
from prx_core.sources.catalog import load_catalog


def test_vlm_caption_failures_fail_coverage_and_block_mds_shards(ray_session, tmp_path: Path) -> None:
    """The `openai` captioner against a real loopback server answering every request with a 500:
    captioner failures, which the coverage check counts and blocks on (the source's own captions
    do not matter to a VLM)."""
    catalog_path = image_folder_source(tmp_path / "src", "vlm_fails", count=3)
    with CaptionServer(SourceCaptioner(CaptionerConfig("source")), "vlm", faults=Faults(rate=1.0, fault=500)) as server:
        captioner = {"backend": "openai", "model": "vlm", "endpoint": server.url, "max_retries": 0}
        resources = build_resources(Settings(root=str(tmp_path / "corpus"), sources=str(catalog_path),
                                             config={"captioner": captioner}))
        instance = fresh_instance(load_catalog(catalog_path))
        result = materialize(resources, PER_SOURCE, "vlm_fails", instance)
        assert server.stats.requests == 3  # never a caption: the stand-in behind the server is not called

    done = materialized(result)
    assert {"raw_source", "samples", "buckets", "phashes", "captions"} <= done.keys()
    assert done["buckets"]["bucketed"] == 3
    assert done["captions"]["failed"] == 3 and done["captions"]["captioned"] == 0
    assert done["captions"]["without_source_caption"] == 0 and "http_error" in done["captions"]["failures"]
    coverage = checks_of(result)["captions_coverage"]
    assert not coverage.passed and coverage.metadata["missing"].value == 3 and coverage.metadata["failed"].value == 3
    assert coverage.severity == dg.AssetCheckSeverity.ERROR
    # blocked: nothing downstream of captions ran
    assert "mds_shards" not in done and "caption_labels" not in done and "caption_embeddings" not in done
    assert not (tmp_path / "corpus" / "mds").exists()
    assert not result.success
    # the failed captions are stored with their error (retried on the next run), not as captions
    rows = read(tmp_path / "corpus", "captions").to_pylist()
    assert len(rows) == 3 and all(r["caption"] == "" and r["error"].startswith("http_error") for r in rows)
