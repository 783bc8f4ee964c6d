"""Stage `caption_embeddings` on real Lance tables, the real packaged MiniLM and a real local Ray.

Each test writes the tables the stage reads (`samples`, `buckets`, `captions`) for a few
sources, then checks what it embeds and reuses, what it commits, and that cosine neighbours
make sense in both vector tables.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from prx_core.models.embeddings import EMBEDDING_DIM, EmbedBatch, EmbedderConfig
from prx_core.stages.caption_embeddings import build_caption_embeddings
from prx_core.store import lance_io, maintenance, schemas
from prx_core.upkeep import compaction
from prx_core.store.storage import Storage

CAPTIONER = "cap-v1"
CAR = "A red sports car parked on a quiet street at night"
CAR_TWIN = "A red sports car parked on a quiet street at night."
CAPTIONS = [CAR, "Scanned page of a printed invoice with a table of amounts", "A cat asleep on a green sofa",
            CAR_TWIN, "Snow-capped mountains reflected in an alpine lake", "A bowl of ramen with a soft-boiled egg"]


pytestmark = pytest.mark.usefixtures("ray_cluster")  # the core tests' one Ray


def vector(seed: int, dim: int) -> list[float]:
    v = np.random.default_rng(seed).standard_normal(dim).astype(np.float32)
    return (v / np.linalg.norm(v)).tolist()


def write_source(storage: Storage, source: str, captions: list[str | None], embeddings: list[list[float] | None],
                 dropped: frozenset[int] = frozenset(), failed: frozenset[int] = frozenset()) -> list[str]:
    """One sample per caption (content `<source>-c<i>`): `samples`, `buckets` (indices in `dropped`
    get no tier) and `captions` (indices in `failed` hold an error; None: no caption row)."""
    n = len(captions)
    ids = [f"{source}/k{i}" for i in range(n)]
    contents = [f"{source}-c{i}" for i in range(n)]
    samples = pa.table({
        "sample_id": ids, "content_id": contents, "source": [source] * n, "source_key": [f"k{i}" for i in range(n)],
        "image": [b"x"] * n, "width": [800] * n, "height": [600] * n, "format": ["JPEG"] * n, "mode": ["RGB"] * n,
        "orientation": [1] * n, "jpeg_quality": [90] * n, "num_bytes": [1] * n, "original_caption": captions,
        "embedding": embeddings, "phash": [None] * n, "metadata": [None] * n, "source_url": [None] * n,
        "match_keys": [None] * n, "signature": [None] * n, "lossless": [None] * n,
    }, schema=schemas.SAMPLES)
    where = f"source = '{source}'"
    lance_io.replace_partition(storage.lance_uri("samples"), where, samples, schemas.SAMPLES)
    buckets = pa.table({
        "sample_id": ids, "source": [source] * n, "content_id": contents, "width": [800] * n, "height": [600] * n,
        "tier": [None if i in dropped else 512 for i in range(n)], "bucket_width": [576] * n,
        "bucket_height": [448] * n, "bucket": ["576x448"] * n, "drop_reason": [None] * n,
    }, schema=schemas.BUCKETS)
    lance_io.replace_partition(storage.lance_uri("buckets"), where, buckets, schemas.BUCKETS)
    rows = [{"content_id": contents[i], "captioner_version": CAPTIONER, "captioner_id": "source", "prompt_version": "",
             "caption": "" if i in failed else c, "word_count": len((c or "").split()),
             "error": "decode_error: x" if i in failed else ""} for i, c in enumerate(captions) if c is not None]
    lance_io.upsert(storage.lance_uri("captions"), pa.Table.from_pylist(rows, schema=schemas.CAPTIONS),
                    ["content_id", "captioner_version"])
    return contents


def table(storage: Storage, name: str, where: str | None = None) -> pa.Table:
    return lance_io.read_table(storage.lance_uri(name), filter=where)


def test_embeds_each_caption_once_and_a_rerun_commits_nothing(tmp_path: Path) -> None:
    storage, config = Storage(str(tmp_path / "corpus")), EmbedderConfig(batch_size=4)
    captions = [*CAPTIONS, "A dropped thumbnail", "An image the captioner failed on"]
    embeddings = [vector(i, 512) for i in range(6)] + [vector(6, 512), vector(7, 512)]
    embeddings[2], embeddings[4] = None, [0.5, 0.5, 0.5]  # null and wrong length: skipped
    embeddings[5] = [float("nan")] + vector(5, 512)[1:]  # not finite: skipped
    contents = write_source(storage, "a", captions, embeddings, dropped=frozenset({6}), failed=frozenset({7}))

    first = build_caption_embeddings("a", storage, CAPTIONER, config)
    assert (first.captioned, first.reused, first.embedded, first.covered) == (6, 0, 6, 6)
    assert first.embeddings_per_second > 0 and first.read_versions.keys() == {"samples", "buckets", "captions"}
    assert (first.source_dim, first.source_rows, first.skipped, first.dim_mismatch) == (512, 5, 3, None)
    stored = table(storage, "caption_embeddings")
    assert sorted(stored["content_id"].to_pylist()) == sorted(contents[:6])  # not the dropped one, not the failure
    assert stored.schema.field("embedding").type == pa.list_(pa.float32(), EMBEDDING_DIM)
    assert set(stored["captioner_version"].to_pylist()) == {CAPTIONER}
    assert set(stored["embedder_version"].to_pylist()) == {config.version()}
    assert set(stored["embedder_id"].to_pylist()) == {config.embedder_id()}
    vectors = np.stack(stored["embedding"].to_numpy(zero_copy_only=False))
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    ids = stored["content_id"].to_pylist()  # the single-process reference: the same model in this process
    reference = EmbedBatch(config)({"content_id": np.array(ids, dtype=object),
                                    "caption": np.array([captions[int(c.rsplit("c", 1)[1])] for c in ids], dtype=object)})
    np.testing.assert_allclose(vectors, reference["embedding"], atol=1e-5)
    sources = table(storage, "source_embeddings")
    assert sources.schema == schemas.source_embeddings_schema(512)
    assert sorted(sources["sample_id"].to_pylist()) == ["a/k0", "a/k1", "a/k3", "a/k6", "a/k7"]  # every sample
    row = sources.filter(pa.compute.equal(sources["sample_id"], "a/k3")).to_pylist()[0]
    assert row["content_id"] == "a-c3" and row["source"] == "a"
    np.testing.assert_allclose(row["embedding"], embeddings[3], atol=1e-7)
    for name in ("caption_embeddings", "source_embeddings"):  # below the index threshold: a note, no index
        assert first.coverage[name].complete and first.coverage[name].index is None
        assert "skipped" in first.indexes[name].notes[0]

    versions = {name: lance_io.table_version(storage.lance_uri(name)) for name in ("caption_embeddings", "source_embeddings")}
    again = build_caption_embeddings("a", storage, CAPTIONER, EmbedderConfig(batch_size=2))  # batch size: same version
    assert (again.embedded, again.reused, again.covered, again.source_written) == (0, 6, 6, False)
    assert {name: lance_io.table_version(storage.lance_uri(name)) for name in versions} == versions
    assert again.caption_embeddings_version == versions["caption_embeddings"]

    # a new captioner embeds again, next to the old rows
    rows = table(storage, "captions").to_pylist()
    for r in rows:
        r["captioner_version"] = "cap-v2"
    lance_io.upsert(storage.lance_uri("captions"), pa.Table.from_pylist(rows, schema=schemas.CAPTIONS),
                    ["content_id", "captioner_version"])
    other = build_caption_embeddings("a", storage, "cap-v2", config)
    assert (other.embedded, other.reused, other.source_written) == (6, 0, False)
    assert table(storage, "caption_embeddings").num_rows == 12


def test_cosine_neighbours_make_sense(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path / "corpus"))
    write_source(storage, "a", CAPTIONS, [vector(i, 64) for i in range(len(CAPTIONS))])
    build_caption_embeddings("a", storage, CAPTIONER, EmbedderConfig())
    ds = lance_io.require_table(storage.lance_uri("caption_embeddings"))
    car = ds.to_table(filter="content_id = 'a-c0'")["embedding"][0].values.to_numpy()
    near = ds.to_table(nearest={"column": "embedding", "q": car, "k": 3, "metric": "cosine"},
                       columns=["content_id", "_distance"]).to_pylist()
    assert [r["content_id"] for r in near[:2]] == ["a-c0", "a-c3"]  # itself, then the near-identical caption
    assert near[0]["_distance"] < 1e-4 and near[1]["_distance"] < 0.05 < near[2]["_distance"]
    sources = lance_io.require_table(storage.lance_uri("source_embeddings"))
    hits = sources.to_table(nearest={"column": "embedding", "q": np.asarray(vector(4, 64)), "k": 1}, columns=["sample_id"])
    assert hits["sample_id"].to_pylist() == ["a/k4"]


def test_another_dimension_is_reported_not_written(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path / "corpus"))
    write_source(storage, "a", CAPTIONS[:3], [vector(i, 512) for i in range(3)])
    write_source(storage, "b", CAPTIONS[3:], [vector(i, 768) for i in range(2)] + [vector(9, 512)])
    write_source(storage, "c", ["A caption without a source vector"], [None])
    build_caption_embeddings("a", storage, CAPTIONER, EmbedderConfig())
    before = lance_io.table_version(storage.lance_uri("source_embeddings"))

    report = build_caption_embeddings("b", storage, CAPTIONER, EmbedderConfig())
    assert report.source_dim == 768 and "768-d" in report.dim_mismatch and "512-d" in report.dim_mismatch
    assert (report.source_rows, report.skipped, report.source_written) == (0, 3, False)
    assert report.embedded == report.covered == 3  # the captions are embedded all the same
    assert lance_io.table_version(storage.lance_uri("source_embeddings")) == before
    assert table(storage, "source_embeddings").schema == schemas.source_embeddings_schema(512)

    none = build_caption_embeddings("c", storage, CAPTIONER, EmbedderConfig())
    assert (none.source_dim, none.dim_mismatch, none.skipped, none.source_rows) == (None, None, 1, 0)
    assert lance_io.table_version(storage.lance_uri("source_embeddings")) == before

    # a re-ingest of `a` without vectors removes its rows; the empty table keeps its width
    write_source(storage, "a", CAPTIONS[:3], [None] * 3)
    cleared = build_caption_embeddings("a", storage, CAPTIONER, EmbedderConfig())
    assert cleared.source_written and cleared.source_rows == 0 and table(storage, "source_embeddings").num_rows == 0


def varied_captions(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    things = ["dog", "lighthouse", "bicycle", "teapot", "glacier", "violin", "tractor", "parrot", "cathedral", "kayak"]
    places = ["at dawn", "in the rain", "on a beach", "in a kitchen", "under neon lights", "in a snowy forest"]
    styles = ["photo", "watercolor", "close-up", "aerial view", "sketch"]
    return [f"{styles[rng.integers(5)]} of a {things[rng.integers(10)]} {places[rng.integers(6)]}, number {i}"
            for i in range(n)]


def test_vector_indexes_cover_every_fragment_and_survive_compaction(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path / "corpus"))
    for seed, source in enumerate(("a", "b")):
        write_source(storage, source, varied_captions(150, seed), [vector(1000 * seed + i, 32) for i in range(150)])
    first = build_caption_embeddings("a", storage, CAPTIONER, EmbedderConfig())
    assert first.indexes["caption_embeddings"].indexes == ["content_id_btree"]  # 150 rows: no vector index yet
    second = build_caption_embeddings("b", storage, CAPTIONER, EmbedderConfig())
    for name in ("caption_embeddings", "source_embeddings"):
        assert second.indexes[name].created == ["embedding_vector"], name
        assert second.coverage[name].complete and second.coverage[name].index == "embedding_vector", name
        desc = lance_io.require_table(storage.lance_uri(name)).describe_indices()
        expected = {("embedding_vector", "IVF_FLAT")} | ({("source_bitmap", "Bitmap"), ("sample_id_btree", "BTree")} if name == "source_embeddings"
                                                        else {("content_id_btree", "BTree")})  # per source / by content
        assert {(d.name, d.index_type) for d in desc} == expected, name  # source_embeddings is per source
    write_source(storage, "c", varied_captions(40, 2), [vector(5000 + i, 32) for i in range(40)])
    third = build_caption_embeddings("c", storage, CAPTIONER, EmbedderConfig())
    assert third.indexes["caption_embeddings"].optimized == ["content_id_btree", "embedding_vector"]  # new rows caught up
    assert all(third.coverage[name].complete for name in third.coverage)

    for name in ("caption_embeddings", "source_embeddings"):
        uri = storage.lance_uri(name)
        before = lance_io.require_table(uri)
        probe = before.to_table(limit=1, offset=170)
        compacted = compaction.compact_table(uri, target_rows_per_fragment=10_000, cleanup_older_than=timedelta(0))
        assert compacted.fragments_before > 1 and compacted.fragments_after == 1, (name, compacted)
        coverage = maintenance.vector_index_coverage(uri, "embedding")
        assert coverage.index == "embedding_vector" and coverage.unindexed_fragments == [] and coverage.complete, name
        ds = lance_io.require_table(uri)
        key = "content_id" if name == "caption_embeddings" else "sample_id"
        near = ds.to_table(nearest={"column": "embedding", "q": probe["embedding"][0].values.to_numpy(), "k": 1},
                           columns=[key])
        assert near[key].to_pylist() == probe[key].to_pylist(), name
        assert ds.count_rows() == before.count_rows() == 340


def test_embedder_config_and_batches() -> None:
    base = EmbedderConfig()
    assert base.version() == EmbedderConfig(batch_size=8).version() and base.dim == EMBEDDING_DIM
    assert base.embedder_id().startswith("minilm:")
    with pytest.raises(ValueError, match="unknown embedder model"):
        EmbedderConfig(model="clip")
    with pytest.raises(ValueError, match="batch_size"):
        EmbedderConfig(batch_size=0)
    out = EmbedBatch(base)({"content_id": np.array(["x", "y"], dtype=object), "caption": np.array([CAR, None], dtype=object)})
    assert out["embedding"].shape == (2, EMBEDDING_DIM) and out["embedding"].dtype == np.float32
    assert list(out["content_id"]) == ["x", "y"] and set(out["embedder_version"]) == {base.version()}
