"""A failing blocking check stops what depends on it in the same run."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
from conftest import checks_of, fresh_instance, image_folder_source, materialize, materialized, read, stream_dirs

from prx_assets.automation import PER_SOURCE
from prx_assets.definitions import build_resources
from prx_assets.settings import Settings
from prx_core.sources.catalog import load_catalog

UP_TO_CAPTIONS = ["raw_source", "samples", "buckets", "phashes", "captions"]


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


def uncaptioned_source(tmp_path: Path, count: int, uncaptioned: int) -> Path:
    """An image folder source of `count` images whose first `uncaptioned` have no caption file."""
    catalog = image_folder_source(tmp_path / "src", "few_missing", count=count)
    for i in range(uncaptioned):
        (tmp_path / "src" / "images" / "part_0" / f"photo_{i}.txt").unlink()
    return catalog


def test_one_uncaptioned_sample_passes_coverage_and_is_left_out_of_mds(ray_session, tmp_path: Path) -> None:
    catalog_path = uncaptioned_source(tmp_path, count=6, uncaptioned=1)
    root = tmp_path / "corpus"
    resources = build_resources(Settings(root=str(root), sources=str(catalog_path),
                                         config={"checks": {"captions_coverage": 0.2}}))
    instance = fresh_instance(load_catalog(catalog_path))
    result = materialize(resources, [*UP_TO_CAPTIONS, "mds_shards"], "few_missing", instance)

    assert result.success
    coverage = checks_of(result)["captions_coverage"]
    assert coverage.passed and coverage.severity == dg.AssetCheckSeverity.ERROR
    meta = {k: v.value for k, v in coverage.metadata.items()}
    assert (meta["checked"], meta["failed"], meta["missing"]) == (6, 1, 1)
    assert meta["failure_rate"] == round(1 / 6, 6) and meta["max_failure_rate"] == 0.2
    offender = "few_missing/part_0/photo_0"
    assert meta["offender_ids"] == [offender] and offender in meta["offenders"]
    assert "no_source_caption" in meta["offenders"]
    # the uncaptioned sample is refused by mds_shards with a counted reason, never written without a caption
    done = materialized(result)
    assert done["mds_shards"]["samples_written"] == 5 and "no_caption" in done["mds_shards"]["rejects"]
    assert checks_of(result)["mds_shards_readable"].passed
    assert len(stream_dirs(root, "few_missing")) == 1
    index = read(root, "mds_index").to_pylist()
    assert len(index) == 5 and offender not in {r["sample_id"] for r in index}
    (reject,) = read(root, "rejects", filter="stage = 'mds_shards'").to_pylist()
    assert (reject["sample_id"], reject["reason"]) == (offender, "no_caption")


def test_mostly_uncaptioned_source_fails_coverage_and_blocks_mds(ray_session, tmp_path: Path) -> None:
    catalog_path = uncaptioned_source(tmp_path, count=6, uncaptioned=4)
    root = tmp_path / "corpus"
    resources = build_resources(Settings(root=str(root), sources=str(catalog_path),
                                         config={"checks": {"captions_coverage": 0.2, "examples": 3}}))
    instance = fresh_instance(load_catalog(catalog_path))
    result = materialize(resources, [*UP_TO_CAPTIONS, "mds_shards"], "few_missing", instance)

    coverage = checks_of(result)["captions_coverage"]
    assert not coverage.passed and coverage.severity == dg.AssetCheckSeverity.ERROR
    meta = {k: v.value for k, v in coverage.metadata.items()}
    assert (meta["checked"], meta["failed"]) == (6, 4)
    assert meta["offender_ids"] == [f"few_missing/part_0/photo_{i}" for i in range(3)]  # `examples` of them
    assert "mds_shards" not in materialized(result) and not (root / "mds").exists() and not result.success
