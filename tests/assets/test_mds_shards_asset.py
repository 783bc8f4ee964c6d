"""`mds_shards`: streams a trainer loads with mosaicml-streaming, equal to the bucket rows."""

from __future__ import annotations

import gc
from collections import Counter
from pathlib import Path

import pytest
from demo_corpus import Corpus, SOURCES, copy_corpus, read, sha256, stream_dirs, tree_digest
from materializing import check, fresh_instance, materialize, materialized, resources_for
from PIL import Image

from prx_core.image.imaging import process_image
from prx_core.models.caption_base import CaptionerConfig
from prx_core.shards.mds.read import read_stream_rows
from prx_core.stages.unchanged import force_next_run
from prx_core.store.storage import Storage

SOURCE_VERSION = CaptionerConfig("source").version()


def bucketed(corpus: Corpus, source: str) -> Counter:
    rows = corpus.rows("buckets", ["tier", "bucket"], f"source = '{source}' AND tier IS NOT NULL")
    return Counter(f"{r['tier']}/{r['bucket']}" for r in rows)


@pytest.mark.parametrize("source", SOURCES)
def test_mds_shards_check_passes_with_counts_equal_to_buckets(corpus: Corpus, source: str) -> None:
    evaluation = corpus.checks[("mds_shards_readable", source)]
    assert evaluation.passed, evaluation.metadata["problems"].value
    meta = corpus.metadata("mds_shards", source)
    expected = bucketed(corpus, source)
    assert meta["samples_written"] == sum(expected.values())
    assert meta["streams"] == len(expected)
    for stream, count in expected.items():
        assert f"| {stream} | {count} | {count} |" in meta["stream_table"], meta["stream_table"]
    index = corpus.rows("mds_index", filter=f"source = '{source}'")
    assert Counter(f"{r['tier']}/{r['bucket']}" for r in index) == expected
    assert not corpus.rows("rejects", filter=f"source = '{source}' AND stage = 'mds_shards'")
    assert not list((corpus.root / "_runs").rglob("run.json"))  # no attempt left behind


@pytest.mark.parametrize("source", SOURCES)
def test_streams_load_with_mosaicml_streaming(corpus: Corpus, source: str) -> None:
    """As the trainer lists them: every `<tier>/<w>x<h>` folder with index.json is a local Stream."""
    import streaming
    from streaming.base.util import clean_stale_shared_memory

    folders = stream_dirs(corpus.root, source)
    expected = bucketed(corpus, source)
    assert sorted(f"{d.parent.name}/{d.name}" for d in folders) == sorted(expected)
    clean_stale_shared_memory()
    dataset = streaming.StreamingDataset(streams=[streaming.Stream(local=str(d)) for d in folders],
                                         batch_size=1, shuffle=False)
    try:
        loaded = list(dataset)
    finally:
        del dataset
        gc.collect()
    assert len(loaded) == sum(expected.values())

    samples = {r["sample_id"]: r for r in corpus.rows(
        "samples", ["sample_id", "content_id", "original_caption", "width", "height"], f"source = '{source}'")}
    buckets = {r["sample_id"]: r for r in corpus.rows("buckets", filter=f"source = '{source}'")}
    captions = {r["content_id"]: r["caption"] for r in corpus.rows("captions", filter=f"captioner_version = '{SOURCE_VERSION}'")}
    keys = corpus.caption_keys(source)
    seen = Counter()
    for item in loaded:
        sid = item["sample_id"]
        seen[sid] += 1
        image, bucket, sample = item["image"], buckets[sid], samples[sid]
        assert isinstance(image, Image.Image) and image.format == "JPEG"
        assert image.size == (bucket["bucket_width"], bucket["bucket_height"]) == (item["width"], item["height"])
        assert item["caption"] == captions[keys[sid]]
        assert item["original_caption"] == (sample["original_caption"] or "")
        assert (item["original_width"], item["original_height"]) == (sample["width"], sample["height"])
        assert item["source"] == source
    assert set(seen) == {sid for sid, b in buckets.items() if b["tier"] is not None}
    assert set(seen.values()) == {1}


@pytest.mark.parametrize("source", SOURCES)
def test_stream_order_and_bytes_match_mds_index_and_the_encode(corpus: Corpus, source: str) -> None:
    """Stored JPEG bytes are the pipeline's own q92 encode (spot-checked by re-encoding the first
    sample of every stream) and the rows sit at the positions `mds_index` records."""
    index = corpus.rows("mds_index", filter=f"source = '{source}'")
    images = {r["sample_id"]: r["image"] for r in corpus.rows("samples", ["sample_id", "image"], f"source = '{source}'")}
    for folder in stream_dirs(corpus.root, source):
        tier, bucket = int(folder.parent.name), folder.name
        rows = read_stream_rows(str(folder), ["sample_id", "image"])
        entries = sorted((r for r in index if r["tier"] == tier and r["bucket"] == bucket), key=lambda r: r["index"])
        assert [r["index"] for r in entries] == list(range(len(rows)))
        assert [r["sample_id"] for r in entries] == [r["sample_id"] for r in rows]
        assert [r["image_sha256"] for r in entries] == [sha256(r["image"]) for r in rows]
        assert [r["sample_id"] for r in rows] == sorted(r["sample_id"] for r in rows)  # deterministic order
        first = process_image(images[rows[0]["sample_id"]])
        assert first.jpeg == rows[0]["image"], folder


def test_rerun_gives_byte_identical_shards(corpus: Corpus, tmp_path: Path) -> None:
    root = copy_corpus(corpus, tmp_path / "corpus")
    source = "crawl_wds"
    before = tree_digest(root / "mds" / source)
    index_before = read(root, "mds_index", filter=f"source = '{source}'").sort_by("sample_id").to_pylist()
    others = {s: tree_digest(root / "mds" / s) for s in SOURCES if s != source}
    assert any(name.endswith("index.json") for name in before)

    assert force_next_run(Storage(str(root)), "mds_shards", source)  # a real rewrite, not the reuse of the committed run
    result = materialize(resources_for(corpus, root), ["mds_shards"], source, fresh_instance(corpus.catalog))
    assert result.success
    assert check(result, "mds_shards_readable").passed
    assert materialized(result)["mds_shards"]["samples_written"] == len(index_before)
    assert tree_digest(root / "mds" / source) == before
    assert read(root, "mds_index", filter=f"source = '{source}'").sort_by("sample_id").to_pylist() == index_before
    assert {s: tree_digest(root / "mds" / s) for s in others} == others
    assert not list((root / "_runs").rglob("run.json"))  # no attempt left behind


def test_small_streams_drop_is_configured_versioned_and_reported(corpus: Corpus, tmp_path: Path) -> None:
    """`training.small_streams: drop` (with the trainer's batch and canonical nodes) changes the
    asset's code version, publishes only the streams that fill a batch per canonical node, and
    names the dropped ones in the metadata; the check then passes."""
    from prx_assets.definitions import build_assets

    root = copy_corpus(corpus, tmp_path / "corpus")
    source = "stock_photos"
    sizes = bucketed(corpus, source)
    minimum = 4
    assert any(n < minimum for n in sizes.values()) and any(n >= minimum for n in sizes.values())
    config = {"training": {"global_batch_size": 2, "canonical_nodes": 2, "small_streams": "drop"}}
    resources = resources_for(corpus, root, config)
    versions = {a.key.to_user_string(): a.code_versions_by_key for a in build_assets(resources)}
    stock = {a.key.to_user_string(): a.code_versions_by_key for a in build_assets(corpus.resources)}
    assert versions["mds_shards"] != stock["mds_shards"] and versions["skip_lists"] == stock["skip_lists"]
    result = materialize(resources, ["mds_shards"], source, fresh_instance(corpus.catalog))
    assert result.success
    meta = materialized(result)["mds_shards"]
    assert meta["streams_dropped"] == {k: n for k, n in sizes.items() if n < minimum}
    assert meta["streams"] == sum(n >= minimum for n in sizes.values())
    assert check(result, "mds_shards_stream_sizes").passed and check(result, "mds_shards_readable").passed
    assert {"/".join(p.parts[-3:-1]) for p in (root / "mds" / source).glob("*/*/index.json")} == \
           {k for k, n in sizes.items() if n >= minimum}
    small = read(root, "rejects", filter=f"source = '{source}' AND stage = 'mds_shards' AND reason = 'small_stream'")
    assert small.num_rows == sum(n for n in sizes.values() if n < minimum)


def test_small_streams_merge_is_configured_versioned_and_reported(corpus: Corpus, tmp_path: Path) -> None:
    """`training.small_streams: merge`: its own code version; the small streams leave the source's
    folder for `mds/_merged`, read back as the source's; nothing is rejected; a merged stream still
    below the minimum (one source alone cannot fill it) is what the size check warns about."""
    from prx_assets.definitions import build_assets

    root = copy_corpus(corpus, tmp_path / "corpus")
    source = "stock_photos"
    sizes = bucketed(corpus, source)
    minimum = 4
    config = {"training": {"global_batch_size": 2, "canonical_nodes": 2, "small_streams": "merge"}}
    resources = resources_for(corpus, root, config)
    drop = resources_for(corpus, root, {"training": {**config["training"], "small_streams": "drop"}})
    versions = {a.key.to_user_string(): a.code_versions_by_key for a in build_assets(resources)}
    dropped = {a.key.to_user_string(): a.code_versions_by_key for a in build_assets(drop)}
    assert versions["mds_shards"] != dropped["mds_shards"]
    result = materialize(resources, ["mds_shards"], source, fresh_instance(corpus.catalog))
    assert result.success
    meta = materialized(result)["mds_shards"]
    small = {k: n for k, n in sizes.items() if n < minimum}
    assert meta["streams_merged"] == small and meta["streams_dropped"] == {}
    assert check(result, "mds_shards_readable").passed
    sizes_check = check(result, "mds_shards_stream_sizes")
    assert not sizes_check.passed and sizes_check.metadata["merged_streams"].value == {f"_merged/{k}": n for k, n in small.items()}
    assert {"/".join(p.parts[-3:-1]) for p in (root / "mds" / source).glob("*/*/index.json")} == set(sizes) - set(small)
    assert {"/".join(p.parts[-3:-1]) for p in (root / "mds" / "_merged").glob("*/*/index.json")} == set(small)
    assert read(root, "rejects", filter=f"source = '{source}' AND reason = 'small_stream'").num_rows == 0
