"""`caption_labels`: zero-shot visual / text / nsfw from caption text (MiniLM)."""

from __future__ import annotations

from collections import Counter

import pytest
from demo_corpus import Corpus, Manifest, SOURCES

from prx_core.models.caption_base import CaptionerConfig
from prx_core.models.label_base import LABELS

SOURCE_VERSION = CaptionerConfig("source").version()


def test_planted_text_heavy_samples_are_labelled_text(corpus: Corpus, manifest: Manifest) -> None:
    planted = manifest.with_kind("text_heavy")
    assert len(planted) == 4 * len(SOURCES)  # four planted text-heavy samples per source
    labels = corpus.labels()
    assert {p.sample_id: labels[p.sample_id] for p in planted} == {p.sample_id: "text" for p in planted}
    text = {sid for sid, label in labels.items() if label == "text"}
    false_positives = text - {p.sample_id for p in planted}
    print(f"text-labelled samples not planted as text-heavy: {sorted(false_positives)}")
    assert len(false_positives) <= 3, sorted(false_positives)  # photos stay photos


def test_labels_cover_every_captioned_content_once(corpus: Corpus) -> None:
    rows = corpus.rows("caption_labels")
    keys = [(r["content_id"], r["captioner_version"], r["labeler_version"]) for r in rows]
    assert len(keys) == len(set(keys))
    assert {r["captioner_version"] for r in rows} == {SOURCE_VERSION}
    assert len({r["labeler_version"] for r in rows}) == 1
    assert {r["label"] for r in rows} <= set(LABELS)
    assert {r["content_id"] for r in rows} == {r["content_id"] for r in corpus.rows("captions")}
    assert all(-1.0 <= r["score"] <= 1.0 for r in rows)


@pytest.mark.parametrize("source", SOURCES)
def test_caption_labels_check_and_metadata(corpus: Corpus, source: str) -> None:
    check = corpus.checks[("caption_labels_coverage", source)]
    assert check.passed
    meta = corpus.metadata("caption_labels", source)
    assert meta["labeler"].startswith("minilm:")
    captions_meta = corpus.metadata("captions", source)
    assert meta["captioned"] == captions_meta["eligible"]
    assert meta["labelled"] + meta["reused"] == meta["captioned"]
    placed = {r["sample_id"] for r in corpus.rows("buckets", ["sample_id"], f"source = '{source}' AND tier IS NOT NULL")}
    keys = {key for sid, key in corpus.caption_keys(source).items() if sid in placed}
    labels = {r["content_id"]: r["label"] for r in corpus.rows("caption_labels")}
    distribution = Counter(labels[k] for k in keys)
    for label, count in distribution.items():
        assert f"| {label} | {count} |" in meta["label_distribution"], meta["label_distribution"]
    assert distribution["text"] >= 4  # four planted text-heavy samples per source
