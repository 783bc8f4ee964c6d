"""`captions`: eligible contents only, each once per captioner version (under the `source`
captioner once per content and source text: a sample's caption is its own); the source and the
transformers backends, the caption checks and their retries; `caption_labels` on top. Under the
`source` captioner, missing source captions are counted and left out of MDS but are no coverage
failure; a source with none at all fails the captions run."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest
from demo_corpus import Corpus, Manifest, SOURCES, copy_corpus, image_folder_source, read, stream_dirs
from materializing import check, checks_of, fresh_instance, make_settings, materialize, materialized, resources_for, transformers_config

from prx_assets.definitions import build_resources
from prx_core.models.caption_base import CaptionerConfig
from prx_core.models.caption_keys import source_caption_key
from prx_core.models.captioning import SOURCE_HAS_NONE
from prx_core.sources.catalog import load_catalog
from prx_core.stages.unchanged import force_next_run
from prx_core.store import lance_io
from prx_core.store.storage import Storage

SOURCE_VERSION = CaptionerConfig("source").version()
UP_TO_MDS = ["raw_source", "samples", "buckets", "phashes", "captions", "mds_shards"]


def eligible(corpus: Corpus, source: str) -> set[str]:
    placed = {r["sample_id"] for r in corpus.rows("buckets", ["sample_id"], f"source = '{source}' AND tier IS NOT NULL")}
    return {r["content_id"] for r in corpus.rows("samples", ["sample_id", "content_id"], f"source = '{source}'")
            if r["sample_id"] in placed}


def keys_of(corpus: Corpus, where: str | None = None) -> dict[str, str]:
    """sample_id -> its caption key under the `source` captioner (its content and its own caption)."""
    return {r["sample_id"]: source_caption_key(r["content_id"], r["original_caption"])
            for r in corpus.rows("samples", ["sample_id", "content_id", "original_caption"], where)}


def eligible_keys(corpus: Corpus, source: str) -> set[str]:
    placed = {r["sample_id"] for r in corpus.rows("buckets", ["sample_id"], f"source = '{source}' AND tier IS NOT NULL")}
    return {k for s, k in keys_of(corpus, f"source = '{source}'").items() if s in placed}


def test_only_eligible_contents_are_captioned_once(corpus: Corpus) -> None:
    rows = corpus.rows("captions")
    keys = [(r["content_id"], r["captioner_version"]) for r in rows]
    assert len(keys) == len(set(keys))
    assert {r["captioner_version"] for r in rows} == {SOURCE_VERSION}
    wanted = set().union(*(eligible_keys(corpus, s) for s in SOURCES))
    assert {r["content_id"] for r in rows} == wanted  # keyed by (content, the sample's own caption)
    # samples that never reached a bucket (dropped) were not captioned unless their bytes and text also bucketed
    dropped = {r["sample_id"] for r in corpus.rows("buckets", ["sample_id"], "tier IS NULL")}
    dropped_keys = {k for s, k in keys_of(corpus).items() if s in dropped}
    assert dropped_keys and not dropped_keys & {r["content_id"] for r in rows}
    assert all(r["error"] == "" and r["caption"] and r["captioner_id"] == "source" for r in rows)
    assert {r["verdict"] for r in rows} <= {"ok", "flagged"} and {r["attempts"] for r in rows} == {0}


def test_source_backend_copies_the_source_caption(corpus: Corpus, source_bytes: dict) -> None:
    captions = {r["content_id"]: r for r in corpus.rows("captions")}
    sources_of: dict[str, set[str]] = {}
    for sample_id, key in keys_of(corpus).items():
        if key in captions:
            sources_of.setdefault(key, set()).add(source_bytes[sample_id][1].strip())
    assert sources_of.keys() == captions.keys()
    for key, caption in captions.items():
        assert {caption["caption"]} == sources_of[key]  # every sample of a key has that very caption
        assert caption["word_count"] == len(caption["caption"].split())
        assert caption["prompt_version"] == ""  # a copied caption used no prompt


def test_byte_identical_image_in_two_sources_is_captioned_once(corpus: Corpus, manifest: Manifest) -> None:
    """stock_photos runs first; web_images' byte copies, under the same caption, reuse its captions."""
    contents = {s: eligible_keys(corpus, s) for s in SOURCES}
    shared = contents["stock_photos"] & contents["web_images"]
    copies = [roles["copy"] for roles in manifest.groups().values() if "copy" in roles]
    assert copies and len(shared) >= len(copies)
    meta = corpus.metadata("captions", "web_images")
    assert meta["reused"] == len(shared)
    assert meta["captioned"] == len(contents["web_images"]) - len(shared)
    assert meta["eligible"] == len(contents["web_images"])
    stock = corpus.metadata("captions", "stock_photos")
    assert (stock["captioned"], stock["reused"]) == (len(contents["stock_photos"]), 0)


@pytest.mark.parametrize("source", SOURCES)
def test_captions_check_and_metadata(corpus: Corpus, source: str) -> None:
    check_ = corpus.checks[("captions_coverage", source)]
    assert check_.passed and check_.metadata["missing"].value == 0
    meta = corpus.metadata("captions", source)
    assert meta["captioner"] == "source"
    assert meta["captioned"] + meta["reused"] == meta["eligible"] == len(eligible_keys(corpus, source))
    quality = corpus.checks[("captions_quality", source)]
    assert quality.passed and quality.metadata["failed"].value == meta["rejected"] == 0
    assert meta["failed"] == 0
    versions = meta["lance_versions"]
    assert versions["captions"] >= 1 and "buckets" in versions and "samples" in versions


def test_full_text_index_covers_every_caption(corpus: Corpus, manifest: Manifest) -> None:
    """The INVERTED index on captions is refreshed after each write: no unindexed rows, and a
    full-text query finds the planted spreadsheet screenshots."""
    ds = lance_io.require_table(Storage(str(corpus.root)).lance_uri("captions"))
    (index,) = [d for d in ds.describe_indices() if list(d.field_names) == ["caption"]]
    assert index.index_type.lower() in ("inverted", "fts")
    stats = ds.stats.index_stats(index.name)
    assert stats["num_unindexed_rows"] == 0 and stats["num_indexed_rows"] == ds.count_rows()
    found = set(ds.to_table(columns=["content_id"], full_text_query="spreadsheet")["content_id"].to_pylist())
    keys = keys_of(corpus)
    spreadsheets = {keys[p.sample_id] for p in manifest.with_kind("spreadsheet")}
    assert spreadsheets and spreadsheets <= found


def test_second_materialization_reuses_every_caption(corpus: Corpus, tmp_path: Path) -> None:
    root = copy_corpus(corpus, tmp_path / "corpus")
    before = read(root, "captions").sort_by([("content_id", "ascending")]).to_pylist()
    assert force_next_run(Storage(str(root)), "captions", "crawl_wds")  # else the committed run is reused whole: nothing runs
    result = materialize(resources_for(corpus, root), ["captions"], "crawl_wds", fresh_instance(corpus.catalog))
    assert result.success
    meta = materialized(result)["captions"]
    assert meta["captioned"] == 0 and meta["failed"] == 0
    assert meta["reused"] == meta["eligible"] == len(eligible_keys(corpus, "crawl_wds"))
    assert check(result, "captions_coverage").passed
    assert read(root, "captions").sort_by([("content_id", "ascending")]).to_pylist() == before


def test_transformers_backend_captions_every_eligible_content(corpus: Corpus, tiny_vlm: Path, tmp_path: Path) -> None:
    """The tiny Qwen2-VL checkpoint on one small source: non-empty captions for every eligible
    content under a new captioner_version; the source backend's rows stay."""
    root = copy_corpus(corpus, tmp_path / "corpus")
    before = read(root, "captions").to_pylist()
    config = {"captioner": transformers_config(tiny_vlm)}
    resources = resources_for(corpus, root, config)
    version = resources["captioner"].config().version()
    assert version != SOURCE_VERSION
    result = materialize(resources, ["captions"], "crawl_wds", fresh_instance(corpus.catalog))
    # every caption rejected: the blocking captions_quality check fails the step, after the captions are stored
    (failure,) = result.get_step_failure_events()
    assert "blocking asset check failed" in str(failure.event_specific_data.error)
    meta = materialized(result)["captions"]
    wanted = eligible(corpus, "crawl_wds")
    assert meta["captioned"] == len(wanted) and meta["reused"] == 0 and meta["failed"] == 0
    assert meta["captioner"].startswith("transformers:tiny-qwen2-vl:")
    # the tiny model's gibberish runs to the token cap (often in a loop): refused, generated once more with
    # the fallback decoding (both attempts' tokens counted, max_new_tokens 8 each), refused again: rejected
    assert len(wanted) * 8 < meta["ops"]["output_tokens"] <= len(wanted) * 16 and meta["output_tokens_per_second"] > 0
    assert meta["fallbacks"] == meta["rejected"] == len(wanted) and meta["retried"] == 0
    assert check(result, "captions_coverage").passed  # a rejected caption is no captioner failure
    quality = check(result, "captions_quality")
    assert not quality.passed and quality.severity == dg.AssetCheckSeverity.ERROR
    assert quality.metadata["failed"].value == len(wanted) and "token_cap" in quality.metadata["problems"].value

    rows = read(root, "captions").to_pylist()
    new = [r for r in rows if r["captioner_version"] == version]
    assert {r["content_id"] for r in new} == wanted and len(new) == len(wanted)
    assert all(r["caption"].strip() and r["error"] == "" and r["word_count"] >= 1 for r in new)
    assert all((r["verdict"], r["attempts"], r["finish_reason"]) == ("rejected", 2, "length") for r in new)
    assert all(r["captioner_id"] == meta["captioner"] and r["prompt_version"] for r in new)
    old = sorted((r for r in rows if r["captioner_version"] == SOURCE_VERSION), key=lambda r: r["content_id"])
    assert old == sorted(before, key=lambda r: r["content_id"])


def uncaptioned_source(tmp_path: Path, count: int, uncaptioned: int) -> Path:
    """An image folder source of `count` images whose first `uncaptioned` have no caption file."""
    catalog = image_folder_source(tmp_path / "src", "few_missing", count=count)
    for i in range(uncaptioned):
        (tmp_path / "src" / "images" / "part_0" / f"photo_{i}.txt").unlink()
    return catalog


def test_missing_source_captions_pass_coverage_and_mds_holds_the_captioned(ray_session, tmp_path: Path) -> None:
    """2 of 6 without a source caption, at the default 0.1% threshold: counted, not failures."""
    catalog_path = uncaptioned_source(tmp_path, count=6, uncaptioned=2)
    root = tmp_path / "corpus"
    result = materialize(build_resources(make_settings(root, catalog_path)), UP_TO_MDS, "few_missing",
                         fresh_instance(load_catalog(catalog_path)))

    assert result.success
    done = materialized(result)
    assert (done["captions"]["captioned"], done["captions"]["failed"], done["captions"]["without_source_caption"]) == (
        4, 0, 2)
    missing = ["few_missing/part_0/photo_0", "few_missing/part_0/photo_1"]
    assert done["captions"]["without_source_caption_examples"] == missing
    coverage = checks_of(result)["captions_coverage"]
    assert coverage.passed and coverage.severity == dg.AssetCheckSeverity.ERROR
    meta = {k: v.value for k, v in coverage.metadata.items()}
    assert (meta["checked"], meta["failed"], meta["missing"], meta["without_source_caption"]) == (6, 0, 2, 2)
    assert meta["offender_ids"] == [] and meta["max_failure_rate"] == 0.001
    # the uncaptioned are refused by mds_shards with a reason that says why; the captioned are written
    assert done["mds_shards"]["samples_written"] == 4 and checks_of(result)["mds_shards_readable"].passed
    assert len(stream_dirs(root, "few_missing")) == 1
    index = read(root, "mds_index").to_pylist()
    assert len(index) == 4 and not set(missing) & {r["sample_id"] for r in index}
    rejects = read(root, "rejects", filter="stage = 'mds_shards'").to_pylist()
    assert sorted((r["sample_id"], r["reason"], r["message"]) for r in rejects) == [
        (sample_id, "no_caption", SOURCE_HAS_NONE) for sample_id in missing]


def test_a_source_without_any_caption_fails_the_captions_run(ray_session, tmp_path: Path) -> None:
    catalog_path = image_folder_source(tmp_path / "src", "no_captions", count=3, captions=False)
    root = tmp_path / "corpus"
    result = materialize(build_resources(make_settings(root, catalog_path)), UP_TO_MDS, "no_captions",
                         fresh_instance(load_catalog(catalog_path)))

    assert not result.success
    (failure,) = result.get_step_failure_events()
    assert failure.step_key == "captions"
    error = str(failure.event_specific_data.error)
    assert "NoSourceCaptions" in error and "source 'no_captions': none of its 3 eligible images has a caption" in error
    assert "configure a VLM captioner" in error and "backend: vllm" in error and "docs/captioning.md" in error
    assert "mds_shards" not in materialized(result) and not (root / "mds").exists()
