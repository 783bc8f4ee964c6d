"""`caption_embeddings` (+ `source_embeddings`): MiniLM caption vectors and the sources' own vectors."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from demo_corpus import Corpus, SOURCES, copy_corpus, read, version_of
from materializing import check, commits_since, fresh_instance, materialize, materialized, resources_for

from prx_assets.automation import compact_corpus
from prx_core.models.caption_base import CaptionerConfig
from prx_core.models.embeddings import EMBEDDING_DIM, EmbedderConfig
from prx_core.stages.unchanged import force_next_run
from prx_core.store import lance_io, maintenance, schemas
from prx_core.store.storage import Storage

SOURCE_VERSION = CaptionerConfig("source").version()
VECTOR_TABLES = ("caption_embeddings", "source_embeddings")


def test_every_caption_is_embedded_once(corpus: Corpus) -> None:
    rows = corpus.table("caption_embeddings")
    assert [(f.name, f.type) for f in rows.schema] == [(f.name, f.type) for f in schemas.CAPTION_EMBEDDINGS]
    assert rows.schema.field("embedding").type == pa.list_(pa.float32(), EMBEDDING_DIM)
    keys = list(zip(*(rows[k].to_pylist() for k in ("content_id", "captioner_version", "embedder_version"))))
    assert len(keys) == len(set(keys))
    assert set(rows["captioner_version"].to_pylist()) == {SOURCE_VERSION}
    assert set(rows["embedder_version"].to_pylist()) == {EmbedderConfig().version()}
    captioned = {r["content_id"] for r in corpus.rows("captions", ["content_id"], "error = ''")}
    assert set(rows["content_id"].to_pylist()) == captioned
    vectors = np.stack(rows["embedding"].to_numpy(zero_copy_only=False))
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


@pytest.mark.parametrize("source", SOURCES)
def test_checks_and_metadata(corpus: Corpus, source: str) -> None:
    for name in ("caption_embeddings_coverage", "caption_embeddings_indexed", "caption_embeddings_source_dims"):
        assert corpus.checks[(name, source)].passed, (name, source)
    meta = corpus.metadata("caption_embeddings", source)
    assert meta["embedder"] == EmbedderConfig().embedder_id()
    assert meta["captioned"] == corpus.metadata("captions", source)["eligible"]
    assert meta["embedded"] + meta["reused"] == meta["captioned"] and meta["embeddings_per_second"] >= 0
    assert {"samples", "buckets", "captions", "caption_embeddings", "source_embeddings"} <= meta["lance_versions"].keys()
    assert set(meta["ops"]["indexes"]) == set(VECTOR_TABLES) and set(meta["index_notes"]) == set(VECTOR_TABLES)
    samples = corpus.rows("samples", ["sample_id", "embedding"], f"source = '{source}'")
    usable = {r["sample_id"] for r in samples if r["embedding"] is not None and len(r["embedding"]) == 512}
    assert (meta["source_rows"], meta["skipped"]) == (len(usable), len(samples) - len(usable))
    assert meta["source_dim"] == (512 if source == "stock_photos" else 0)
    assert bool(usable) == (source == "stock_photos")  # the demo's only source with a CLIP column


def test_source_embeddings_copy_the_sources_vectors(corpus: Corpus) -> None:
    rows = corpus.table("source_embeddings")
    assert rows.schema == schemas.source_embeddings_schema(512) == schemas.SOURCE_EMBEDDINGS
    assert set(rows["source"].to_pylist()) == {"stock_photos"}
    samples = {r["sample_id"]: r for r in corpus.rows("samples", ["sample_id", "content_id", "embedding"],
                                                      "source = 'stock_photos'")}
    assert rows.num_rows == len({s for s, r in samples.items() if r["embedding"]}) > 0
    for row in rows.to_pylist():
        assert row["content_id"] == samples[row["sample_id"]]["content_id"]
        np.testing.assert_array_equal(np.float32(row["embedding"]), np.float32(samples[row["sample_id"]]["embedding"]))


def test_nearest_caption_is_itself_or_the_same_text(corpus: Corpus) -> None:
    ds = lance_io.require_table(Storage(str(corpus.root)).lance_uri("caption_embeddings"))
    captions = {r["content_id"]: r["caption"] for r in corpus.rows("captions", ["content_id", "caption"])}
    probes = ds.to_table(columns=["content_id", "embedding"]).take([0, 17, 42, 99])
    for cid, vec in zip(probes["content_id"].to_pylist(), probes["embedding"].to_numpy(zero_copy_only=False)):
        (hit,) = ds.to_table(nearest={"column": "embedding", "q": vec, "k": 1, "metric": "cosine"},
                             columns=["content_id", "_distance"]).to_pylist()
        assert hit["_distance"] < 1e-4 and captions[hit["content_id"]] == captions[cid], (cid, hit)


def test_rematerialization_embeds_nothing_and_commits_nothing(corpus: Corpus, tmp_path: Path) -> None:
    root = copy_corpus(corpus, tmp_path / "corpus")
    before = {t: version_of(root, t) for t in VECTOR_TABLES}
    first = corpus.metadata("caption_embeddings", "stock_photos")
    resources = resources_for(corpus, root)
    # the plain rerun stands on the recorded commit: its report is the first run's, nothing is written
    result = materialize(resources, ["caption_embeddings"], "stock_photos", fresh_instance(corpus.catalog))
    assert result.success
    meta = materialized(result)["caption_embeddings"]
    assert {k: meta[k] for k in ("embedded", "reused", "captioned", "source_rows")} == {
        k: first[k] for k in ("embedded", "reused", "captioned", "source_rows")}
    assert check(result, "caption_embeddings_coverage").passed
    # forced to run, it finds every caption embedded already
    assert force_next_run(Storage(str(root)), "caption_embeddings", "stock_photos")
    result = materialize(resources, ["caption_embeddings"], "stock_photos", fresh_instance(corpus.catalog))
    meta = materialized(result)["caption_embeddings"]
    assert meta["embedded"] == 0 and meta["reused"] == meta["captioned"] > 0
    assert meta["source_rows"] == first["source_rows"]
    assert {t: commits_since(root, t, before[t]) for t in VECTOR_TABLES} == {t: [] for t in VECTOR_TABLES}
    assert check(result, "caption_embeddings_coverage").passed


def test_compaction_keeps_vector_indexes_whole(corpus: Corpus, tmp_path: Path) -> None:
    """compact_corpus catches the vector indexes up and they survive the fragment rewrite: every
    fragment is indexed afterwards and `nearest=` finds a row through the index."""
    root = copy_corpus(corpus, tmp_path / "corpus")
    storage = Storage(str(root))
    for table in VECTOR_TABLES:  # demo tables are small: index them now whatever the threshold says
        maintenance.refresh_indexes(storage.lance_uri(table), [], "embedding", min_vector_rows=1)
    # unindexed fragments, as a re-ingest leaves them: the same rows written again
    stock = read(root, "source_embeddings", filter="source = 'stock_photos'")
    lance_io.replace_partition(storage.lance_uri("source_embeddings"), "source = 'stock_photos'", stock,
                               schemas.SOURCE_EMBEDDINGS)
    half = read(root, "caption_embeddings").slice(0, 60)
    lance_io.upsert(storage.lance_uri("caption_embeddings"), half, ["content_id", "captioner_version", "embedder_version"])
    counts = {t: lance.dataset(storage.lance_uri(t)).count_rows() for t in VECTOR_TABLES}
    assert all(maintenance.vector_index_coverage(storage.lance_uri(t), "embedding").unindexed_fragments
               for t in VECTOR_TABLES)

    result = compact_corpus.execute_in_process(resources=resources_for(corpus, root), instance=fresh_instance(corpus.catalog))
    assert result.success
    assert "caption_embeddings" in {e.asset_key.to_user_string() for e in result.get_asset_observation_events()}
    for table, key in (("caption_embeddings", "content_id"), ("source_embeddings", "sample_id")):
        uri = storage.lance_uri(table)
        coverage = maintenance.vector_index_coverage(uri, "embedding", min_rows=1)
        assert coverage.index == "embedding_vector" and coverage.unindexed_fragments == [] and coverage.complete, table
        ds = lance.dataset(uri)
        assert ds.count_rows() == counts[table] and len(ds.get_fragments()) == 1, table
        (index,) = [d for d in ds.describe_indices() if d.name == "embedding_vector"]
        assert {int(f) for s in index.segments for f in s.fragment_ids} == {f.fragment_id for f in ds.get_fragments()}
        probe = ds.to_table(columns=[key, "embedding"], limit=1, offset=7)
        plan = ds.scanner(nearest={"column": "embedding", "q": probe["embedding"][0].values.to_numpy(), "k": 1},
                          columns=[key]).explain_plan()
        assert "ANNSubIndex" in plan and "KNNVectorDistance" not in plan, plan  # the index alone, no flat scan
        hit = ds.to_table(nearest={"column": "embedding", "q": probe["embedding"][0].values.to_numpy(), "k": 1},
                          columns=[key])
        assert hit[key].to_pylist() == probe[key].to_pylist(), table


# -- a source whose vectors are wider than the table's; explorer links -----------------------------------

def wide_clip_source(folder: Path, dim: int = 768) -> Path:
    """A parquet source of 3 noise JPEGs with captions and `dim`-d embeddings; its catalog path."""
    import io

    import pyarrow.parquet as pq
    import yaml
    from PIL import Image

    rng = np.random.default_rng(11)
    rows = []
    for i in range(3):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)).save(buffer, "JPEG", quality=90)
        rows.append({"key": f"wide_{i}", "image": buffer.getvalue(), "caption": f"A wide-vector test picture {i}",
                     "embedding": rng.standard_normal(dim).astype(np.float32).tolist()})
    (folder / "data").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=pa.schema([
        ("key", pa.string()), ("image", pa.binary()), ("caption", pa.string()),
        ("embedding", pa.list_(pa.float32(), dim))])), folder / "data" / "part-0.parquet")
    catalog = folder / "sources.yaml"
    catalog.write_text(yaml.safe_dump({"sources": [{
        "name": "wide_clip", "format": "parquet", "uri": "data", "image_column": "image", "caption_column": "caption",
        "key_column": "key", "embedding_column": "embedding"}]}))
    return catalog


@pytest.fixture(scope="module")
def wide(corpus: Corpus, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dg.ExecuteInProcessResult, int]:
    """The corpus copy plus `wide_clip` (768-d), materialized with an explorer configured."""
    from prx_assets.definitions import build_resources
    from prx_assets.settings import Settings
    from prx_core.sources.catalog import load_catalog

    work = tmp_path_factory.mktemp("wide")
    root, catalog = copy_corpus(corpus, work / "corpus"), wide_clip_source(work / "src")
    before = version_of(root, "source_embeddings")
    config = {"explorer": {"base_url": "http://explorer.test:8080/"}}
    resources = build_resources(Settings(root=str(root), sources=str(catalog), config=config))
    selection = ["raw_source", "samples", "buckets", "captions", "caption_embeddings"]
    return root, materialize(resources, selection, "wide_clip", fresh_instance(load_catalog(catalog))), before


def test_a_source_of_another_dimension_fails_a_check_and_writes_nothing(wide) -> None:
    root, result, before = wide
    assert result.success  # not blocking: nothing downstream needs source vectors
    dims = check(result, "caption_embeddings_source_dims")
    assert not dims.passed and dims.severity == dg.AssetCheckSeverity.ERROR and not dims.blocking
    assert "768-d" in dims.metadata["note"].value and "512-d" in dims.metadata["note"].value
    meta = materialized(result)["caption_embeddings"]
    assert (meta["source_dim"], meta["source_rows"], meta["skipped"], meta["embedded"]) == (768, 0, 3, 3)
    assert check(result, "caption_embeddings_coverage").passed
    assert version_of(root, "source_embeddings") == before
    stored = read(root, "source_embeddings")
    assert stored.schema == schemas.SOURCE_EMBEDDINGS and not pc.any(pc.equal(stored["source"], "wide_clip")).as_py()


def test_explorer_links_when_configured_only(corpus: Corpus, wide) -> None:
    _, result, _ = wide
    meta = materialized(result)
    for asset in ("samples", "captions"):
        assert meta[asset]["explorer"] == "http://explorer.test:8080/?source=wide_clip", asset
    events = {e.asset_key.to_user_string(): e.materialization.metadata for e in result.get_asset_materialization_events()}
    assert isinstance(events["samples"]["explorer"], dg.UrlMetadataValue)
    for source in SOURCES:  # the shared corpus has no explorer configured: no key at all
        for asset in ("samples", "captions"):
            assert "explorer" not in corpus.metadata(asset, source), (asset, source)
