"""`buckets`: tier and bucket of every sample, planted out-of-bounds samples dropped with a reason."""

from __future__ import annotations

from collections import Counter

import pytest
from demo_corpus import BUCKETS_REASONS, Corpus, Manifest, SOURCES, by

from prx_core.image.buckets import TIERS, assign_bucket, bucket_sizes


@pytest.mark.parametrize("source", SOURCES)
def test_planted_out_of_bounds_samples_are_dropped_with_their_reason(
    corpus: Corpus, manifest: Manifest, source: str
) -> None:
    rows = by(corpus.rows("buckets", filter=f"source = '{source}'"), "sample_id")
    rejects = by(corpus.rows("rejects", filter=f"source = '{source}' AND stage = 'buckets'"), "sample_id")
    planted = [p for p in manifest.of(source) if p.reject in BUCKETS_REASONS]
    assert planted, "the demo plants below_floor and aspect_ratio samples in every source"
    for p in planted:
        assert rows[p.sample_id]["drop_reason"] == p.reject, (p, rows[p.sample_id])
        assert rows[p.sample_id]["tier"] is None and rows[p.sample_id]["bucket"] is None
        assert rejects[p.sample_id]["reason"] == p.reject
        assert rejects[p.sample_id]["source_key"] == p.source_key
        assert (rejects[p.sample_id]["width"], rejects[p.sample_id]["height"]) == tuple(p.planted.size)
    assert set(rejects) == {p.sample_id for p in planted}
    dropped = {sid for sid, r in rows.items() if r["drop_reason"] is not None}
    assert dropped == {p.sample_id for p in planted}


@pytest.mark.parametrize("source", SOURCES)
def test_every_sample_has_one_bucket_row_from_the_trainer_set(corpus: Corpus, source: str) -> None:
    samples = by(corpus.rows("samples", ["sample_id", "content_id", "width", "height"], f"source = '{source}'"), "sample_id")
    rows = corpus.rows("buckets", filter=f"source = '{source}'")
    assert sorted(r["sample_id"] for r in rows) == sorted(samples)
    for row in rows:
        sample = samples[row["sample_id"]]
        assert (row["width"], row["height"], row["content_id"]) == (sample["width"], sample["height"], sample["content_id"])
        if row["drop_reason"] is not None:
            continue
        assert row["tier"] in TIERS
        assert (row["bucket_width"], row["bucket_height"]) in bucket_sizes(row["tier"]), row
        assert row["bucket"] == f"{row['bucket_width']}x{row['bucket_height']}"
        expected = assign_bucket(row["width"], row["height"])
        assert (expected.tier, expected.width, expected.height) == (row["tier"], row["bucket_width"], row["bucket_height"])


@pytest.mark.parametrize("source", SOURCES)
def test_buckets_check_and_metadata(corpus: Corpus, source: str) -> None:
    check = corpus.checks[("buckets_in_trainer_set", source)]
    assert check.passed
    meta = corpus.metadata("buckets", source)
    rows = corpus.rows("buckets", filter=f"source = '{source}'")
    placed = [r for r in rows if r["tier"] is not None]
    assert check.metadata["rows_checked"].value == len(placed)
    assert check.metadata["buckets_checked"].value == len({(r["tier"], r["bucket"]) for r in placed})
    assert meta["rows"] == len(rows) and meta["bucketed"] == len(placed)
    assert meta["dropped"] == len(rows) - len(placed)
    histogram = Counter(f"{r['tier']}/{r['bucket']}" for r in placed)
    for name, count in histogram.items():
        assert f"| {name} | {count} |" in meta["bucket_histogram"], meta["bucket_histogram"]
    for reason, count in Counter(r["drop_reason"] for r in rows if r["drop_reason"]).items():
        assert f"| {reason} | {count} |" in meta["drop_reasons"]
    assert meta["lance_versions"]["buckets"] >= 1
