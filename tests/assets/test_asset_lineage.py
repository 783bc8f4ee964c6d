"""Lineage: every asset records the Lance versions it read and wrote, as one `lance_versions`
metadata entry ({table: version}; its data version is a digest of content: test_asset_conventions)."""

from __future__ import annotations

import pytest
from demo_corpus import Corpus, SOURCES

READS = {  # asset -> tables it reads
    "buckets": {"samples"},
    "phashes": {"samples"},
    "captions": {"samples", "buckets"},
    "mds_shards": {"samples", "buckets", "captions"},
    "caption_embeddings": {"samples", "buckets", "captions"},
    "duplicates": {"phashes"},
    "explorer": {"samples", "buckets", "phashes", "duplicates", "captions", "caption_labels", "mds_index"},
}
WRITES = {"samples": "samples", "buckets": "buckets", "phashes": "phashes", "captions": "captions",
          "caption_labels": "caption_labels", "caption_embeddings": "caption_embeddings", "mds_shards": "mds_index",
          "duplicates": "duplicates", "explorer": "explorer"}


@pytest.mark.parametrize("asset", sorted(READS))
def test_versions_read_are_recorded(corpus: Corpus, asset: str) -> None:
    for partition in ([None] if asset == "duplicates" else SOURCES):
        meta = corpus.metadata(asset, partition)
        assert READS[asset] <= meta["lance_versions"].keys(), (asset, partition, meta["lance_versions"])


@pytest.mark.parametrize("asset", sorted(WRITES))
def test_versions_written_are_recorded(corpus: Corpus, asset: str) -> None:
    for partition in ([None] if asset == "duplicates" else SOURCES):
        value = corpus.metadata(asset, partition)["lance_versions"][WRITES[asset]]
        assert isinstance(value, int) and value >= 1


@pytest.mark.parametrize(("asset", "table"), [("caption_labels", "captions"), ("skip_lists", "caption_labels")])
def test_label_versions_read_are_recorded(corpus: Corpus, asset: str, table: str) -> None:
    assert table in corpus.metadata(asset, "web_images")["lance_versions"]


@pytest.mark.parametrize(("writer", "reader", "table"), [("samples", "buckets", "samples"),
                                                         ("captions", "mds_shards", "captions")])
def test_the_version_written_is_the_version_the_next_asset_reads(corpus: Corpus, writer: str, reader: str,
                                                                 table: str) -> None:
    """Within one source's chain nothing else writes in between, so both must agree."""
    for source in SOURCES:
        written = corpus.metadata(writer, source)["lance_versions"][table]
        assert corpus.metadata(reader, source)["lance_versions"][table] == written, source
