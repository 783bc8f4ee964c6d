"""`raw_source` and `samples` (+ `rejects`) materialized from the demo sources."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from demo_corpus import Corpus, Manifest, SAMPLES_REASONS, SOURCES, by, copy_corpus, image_folder_source, read, sha256, version_of
from materializing import INDEX_OPERATIONS, check, commits_since, data_version, fresh_instance, make_settings, materialize, materialized, resources_for

from prx_assets.definitions import build_resources
from prx_core.sources.catalog import load_catalog
from prx_core.stages.unchanged import force_next_run
from prx_core.store.storage import Storage


def test_build_runs_every_chain_then_duplicates_then_skip_lists(corpus: Corpus, record_property) -> None:
    """`run_build`'s order, one run each, all successful; the build time is recorded."""
    record_property("build_seconds", round(corpus.seconds, 1))
    headers = [line for line in corpus.log if line.startswith("==> ")]
    chain = "raw_source, samples, buckets, phashes, captions, caption_labels, caption_embeddings, text_latents, mds_shards"
    assert headers == [f"==> {chain} [{s}]" for s in SOURCES] + ["==> duplicates"] + [f"==> skip_lists, explorer [{s}]" for s in SOURCES]
    assert corpus.outcome.runs == 2 * len(SOURCES) + 1 and corpus.outcome.ok  # a chain and skip_lists per source, duplicates
    assert {(a, p) for a, p in corpus.outcome.metadata} == (
        {(a, s) for a in chain.split(", ") + ["skip_lists", "explorer"] for s in SOURCES} | {("duplicates", None)})
    # skip fractions above 10% and streams smaller than a training batch (every demo stream) are
    # warnings, never failures
    assert all(w.startswith(("skip_lists_fraction[", "mds_shards_stream_sizes[")) for w in corpus.outcome.warnings)


def test_raw_source_observes_each_source_without_copying(corpus: Corpus) -> None:
    for source in SOURCES:
        meta = corpus.metadata("raw_source", source)
        spec = corpus.catalog.get(source)
        assert meta["format"] == spec.format
        assert meta["files"] >= 1 and meta["bytes"] > 0 and meta["fingerprint"]
    assert not (corpus.root / "raw_source").exists()


@pytest.mark.parametrize("source", SOURCES)
def test_every_planted_file_is_a_sample_or_a_reject_with_its_reason(
    corpus: Corpus, manifest: Manifest, source: str
) -> None:
    samples = by(corpus.rows("samples", ["sample_id", "source", "source_key", "width", "height", "format"],
                             f"source = '{source}'"), "sample_id")
    rejects = by(corpus.rows("rejects", filter=f"source = '{source}' AND stage = 'samples'"), "sample_id")
    planted = manifest.of(source)
    assert planted
    for p in planted:
        if p.reject in SAMPLES_REASONS:
            assert p.sample_id not in samples, p
            assert p.sample_id in rejects, p
            assert rejects[p.sample_id]["reason"] == p.reject, (p, rejects[p.sample_id])
            assert rejects[p.sample_id]["source_key"] == p.source_key
            assert rejects[p.sample_id]["message"]
        else:  # decodable: a sample with its upright size (buckets may drop it later)
            assert p.sample_id in samples, p
            row = samples[p.sample_id]
            assert row["source_key"] == p.source_key
            assert (row["width"], row["height"]) == tuple(p.planted.size), (p, row)
            assert row["format"] == p.planted.format, (p, row)
    # nothing unplanned
    assert set(samples) | set(rejects) == {p.sample_id for p in planted}
    assert not set(samples) & set(rejects)


@pytest.mark.parametrize("source", SOURCES)
def test_samples_keep_source_bytes_and_captions(corpus: Corpus, source_bytes: dict, source: str) -> None:
    rows = corpus.rows("samples", ["sample_id", "content_id", "image", "num_bytes", "original_caption"],
                       f"source = '{source}'")
    assert rows
    for row in rows:
        data, caption = source_bytes[row["sample_id"]]
        assert row["image"] == data
        assert row["content_id"] == sha256(data)
        assert row["num_bytes"] == len(data)
        assert row["original_caption"] == caption


@pytest.mark.parametrize("source", SOURCES)
def test_samples_metadata_counts_and_reasons(corpus: Corpus, manifest: Manifest, source: str) -> None:
    meta = corpus.metadata("samples", source)
    planted = manifest.of(source)
    refused = Counter(p.reject for p in planted if p.reject in SAMPLES_REASONS)
    assert meta["rows"] == len(planted) - sum(refused.values())
    assert meta["rejects"] == sum(refused.values())
    assert meta["images_per_second"] > 0
    assert isinstance(meta["lance_versions"]["samples"], int) and isinstance(meta["lance_versions"]["rejects"], int)
    table = meta["reject_reasons"]
    assert table.startswith("| reason | count | share |") if refused else table == "(none)"
    for reason, count in refused.items():
        assert f"| {reason} | {count} |" in table, table
    assert {r["reason"] for r in meta["rejected_files"]} == set(refused)


@pytest.mark.parametrize("source", SOURCES)
def test_samples_checks_pass(corpus: Corpus, source: str) -> None:
    unique = corpus.checks[("samples_unique_sample_ids", source)]
    assert unique.passed
    assert unique.metadata["rows"].value == unique.metadata["distinct"].value == corpus.metadata("samples", source)["rows"]
    assert corpus.checks[("samples_reject_reasons", source)].passed
    assert ("samples_fragment_health", source) in corpus.checks


def test_sample_ids_are_unique_across_the_table(corpus: Corpus) -> None:
    ids = corpus.table("samples", ["sample_id"])["sample_id"].to_pylist()
    assert len(ids) == len(set(ids))
    assert Counter(i.split("/", 1)[0] for i in ids) == {s: corpus.metadata("samples", s)["rows"] for s in SOURCES}


def test_original_captions_are_full_text_indexed(corpus: Corpus) -> None:
    import lance

    from prx_core.store.storage import Storage

    ds = lance.dataset(Storage(str(corpus.root)).lance_uri("samples"))
    (index,) = [d for d in ds.describe_indices() if list(d.field_names) == ["original_caption"]]
    stats = ds.stats.index_stats(index.name)
    assert stats["num_unindexed_rows"] == 0 and stats["num_indexed_rows"] == ds.count_rows()
    hits = ds.to_table(columns=["sample_id", "original_caption"], full_text_query="spreadsheet").to_pylist()
    assert hits and all("spreadsheet" in h["original_caption"].lower() for h in hits)


def test_rerun_of_one_partition_is_one_commit_and_idempotent(corpus: Corpus, tmp_path: Path) -> None:
    """Materializing `samples` again for web_images: exactly one new Lance version, the same
    rows, no duplicates, and the other sources' rows untouched (same row addresses)."""
    root = copy_corpus(corpus, tmp_path / "corpus")
    columns = ["sample_id", "content_id", "source_key", "width", "height"]
    before_version = version_of(root, "samples")
    before = read(root, "samples", columns)
    others = read(root, "samples", ["sample_id"], "source != 'web_images'").to_pylist()
    addresses_before = read_addresses(root, "source != 'web_images'")
    rejects_before = read(root, "rejects", filter="source = 'web_images' AND stage = 'samples'").sort_by("sample_id")

    resources = resources_for(corpus, root)
    assert force_next_run(Storage(str(root)), "samples", "web_images")  # unchanged, it would be a no-op: this is about the rewrite
    result = materialize(resources, ["samples"], "web_images", fresh_instance(corpus.catalog))
    assert result.success
    meta = materialized(result)["samples"]
    commits = commits_since(root, "samples", before_version)
    data = [(v, op) for v, op in commits if op not in INDEX_OPERATIONS]
    assert [op for _, op in data] == ["Update"], commits  # index refreshes aside, one commit
    assert meta["lance_versions"]["samples"] == commits[-1][0]  # what `buckets` will read, index included

    after = read(root, "samples", columns)
    assert after.num_rows == before.num_rows
    assert sorted(after.to_pylist(), key=lambda r: r["sample_id"]) == sorted(before.to_pylist(), key=lambda r: r["sample_id"])
    assert read(root, "samples", ["sample_id"], "source != 'web_images'").to_pylist() == others
    assert read_addresses(root, "source != 'web_images'") == addresses_before
    rejects_after = read(root, "rejects", filter="source = 'web_images' AND stage = 'samples'").sort_by("sample_id")
    assert rejects_after.to_pylist() == rejects_before.to_pylist()
    assert check(result, "samples_unique_sample_ids").passed


def read_addresses(root: Path, predicate: str) -> dict[str, int]:
    """sample_id -> Lance row address: equal addresses mean the rows were not rewritten."""
    import lance

    from prx_core.store.storage import Storage

    table = lance.dataset(Storage(str(root)).lance_uri("samples")).to_table(
        columns=["sample_id"], filter=predicate, with_row_address=True)
    return dict(zip(table["sample_id"].to_pylist(), table["_rowaddr"].to_pylist()))


def test_source_that_lost_a_file_is_seen_and_its_row_removed(ray_session, tmp_path: Path) -> None:
    """raw_source's fingerprint (in its data version) changes when a file goes; the rerun of
    `samples` and `buckets` drops exactly that row."""
    catalog = image_folder_source(tmp_path / "src", "tiny", count=3)
    root = tmp_path / "corpus"
    resources = build_resources(make_settings(root, catalog))
    instance = fresh_instance(load_catalog(catalog))
    first = materialize(resources, ["raw_source", "samples", "buckets"], "tiny", instance)
    assert first.success
    ids = sorted(read(root, "samples", ["sample_id"])["sample_id"].to_pylist())
    assert ids == ["tiny/part_0/photo_0", "tiny/part_0/photo_1", "tiny/part_0/photo_2"]

    (tmp_path / "src" / "images" / "part_0" / "photo_1.jpg").unlink()
    second = materialize(resources, ["raw_source", "samples", "buckets"], "tiny", instance)
    assert second.success
    fingerprints = [materialized(r)["raw_source"]["fingerprint"] for r in (first, second)]
    assert fingerprints[0] != fingerprints[1]
    # data versions from content: the changed listing marks `samples` stale, and its new rows `buckets`
    assert data_version(second, "raw_source") != data_version(first, "raw_source")
    assert data_version(second, "samples") != data_version(first, "samples")
    assert sorted(read(root, "samples", ["sample_id"])["sample_id"].to_pylist()) == [ids[0], ids[2]]
    assert sorted(read(root, "buckets", ["sample_id"])["sample_id"].to_pylist()) == [ids[0], ids[2]]
