"""Dagster's conventions, as a Dagster user expects them: descriptions, owners, true kinds,
Dagster's standard metadata, content data versions and per-partition check results.

Reads the session's demo corpus where it only reads; the staleness and check tests build a
two-source image-folder corpus once (module fixture) on a fresh instance."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import numpy as np
import pytest
import yaml
from demo_corpus import read, version_of
from materializing import fresh_instance, make_settings, materialize
from dagster._core.asset_graph_view.asset_graph_view import AssetGraphView, TemporalContext
from dagster._core.definitions.data_version import CachingStaleStatusResolver, StaleStatus
from dagster._core.storage.asset_check_execution_record import AssetCheckExecutionRecordStatus
from dagster._time import get_current_datetime
from PIL import Image

from prx_assets.common import human_bytes, human_seconds
from prx_assets.definitions import build_assets, build_definitions, build_resources
from prx_assets.settings import ALL_ASSETS, load_settings
from prx_core.shards.mds.streams import MDS_COLUMNS
from prx_core.sources.catalog import load_catalog
from prx_core.stages.unchanged import force_next_run
from prx_core.store.schemas import TABLES
from prx_core.store.storage import Storage

OPS_KEYS = {"units", "units_run", "units_resumed", "worker_peak_rss_mb", "ray_nodes", "fragments_read", "lance_commits"}
TABLE_OF = {"samples": "samples", "buckets": "buckets", "phashes": "phashes", "duplicates": "duplicates",
            "captions": "captions", "caption_labels": "caption_labels", "caption_embeddings": "caption_embeddings",
            "text_latents": "text_latents", "explorer": "explorer"}
PLOTTED = {"samples": ["reject_rate", "images_per_second"], "buckets": ["drop_rate"], "captions": ["captioned_share"],
           "mds_shards": ["images_per_second"], "skip_lists": ["skip_fraction"], "duplicates": ["duplicate_rate"],
           "explorer": ["captioned_rate"]}
CHAIN = ["raw_source", "samples", "buckets", "captions", "mds_shards"]


def graph_of(root: str, sources: Path, config: dict | None = None):
    return build_definitions(make_settings(root, sources, config)).resolve_asset_graph()


def test_every_asset_has_a_description_owners_and_true_kinds(demo_dir: Path, tmp_path: Path) -> None:
    sources = demo_dir / "sources.yaml"
    local = graph_of(str(tmp_path / "corpus"), sources)
    assert {k.to_user_string() for k in local.get_all_asset_keys()} == set(ALL_ASSETS) | {"corpus_plan"}
    for key in local.get_all_asset_keys():
        node = local.get(key)
        assert node.description and len(node.description) > 40, key
        assert node.owners == ["team:data"], key
        assert "s3" not in node.kinds, (key, node.kinds)
    kinds = {k.to_user_string(): set(local.get(k).kinds) for k in local.get_all_asset_keys()}
    assert kinds["mds_shards"] == {"ray", "mds", "filesystem"} and kinds["samples"] == {"ray", "lance", "filesystem"}
    formats = {s.format for s in load_catalog(sources).sources}
    assert formats == {"imagefolder", "parquet", "webdataset", "huggingface"}  # the demo: four formats
    # four formats: at most three tags (the Catalog list's cell), so where the sources are; `format` per partition
    assert kinds["raw_source"] == {"filesystem"} and all(len(k) <= 3 for k in kinds.values()), kinds
    assert kinds["corpus_plan"] == {"ray"}  # it writes nothing under the root

    on_s3 = graph_of("s3://prx-corpus/prx", sources, {"storage": {"owners": ["team:ml-data", "data@example.com"]}})
    for key in on_s3.get_all_asset_keys():
        node, name = on_s3.get(key), key.to_user_string()
        assert node.owners == ["team:ml-data", "data@example.com"], name
        # the corpus is on S3; the demo's sources stay on the local disk
        where = {"filesystem"} if name == "raw_source" else set() if name == "corpus_plan" else {"s3"}
        assert node.kinds & {"s3", "filesystem"} == where, (name, node.kinds)


def test_an_owner_dagster_would_refuse_is_refused_naming_the_setting(tmp_path: Path) -> None:
    config = tmp_path / "prx.yaml"
    config.write_text(yaml.safe_dump({"storage": {"owners": ["data team"]}}))
    settings = load_settings({"PRX_CONFIG": str(config), "PRX_ROOT": str(tmp_path)})
    with pytest.raises(ValueError, match=r"storage\.owners: \['data team'\] are not owners; use `team:<name>`"):
        build_definitions(settings)


def test_materializations_carry_row_count_schema_uri_and_root(corpus) -> None:
    seen = set()
    for (asset, partition), meta in corpus.outcome.metadata.items():
        seen.add(asset)
        assert isinstance(meta["dagster/row_count"], int), (asset, partition)
        if asset != "raw_source":
            columns = [c.name for c in meta["dagster/column_schema"].columns]
            expected = list(MDS_COLUMNS) if asset == "mds_shards" else (
                ["index", "sample_id", "reason"] if asset == "skip_lists" else TABLES[TABLE_OF[asset]].names)
            assert columns == expected, asset
        assert meta["prx/root"] == str(corpus.root), asset
        assert str(meta["dagster/uri"]).startswith(str(corpus.root)) or asset == "raw_source", asset
        assert not OPS_KEYS & meta.keys() and not any(k.startswith("lance_version/") for k in meta), (asset, sorted(meta))
        if asset != "raw_source":  # how it ran, and its lineage: one JSON entry each, out of the plots
            assert isinstance(meta["ops"], dict) and isinstance(meta["lance_versions"], dict)
            assert meta["lance_versions"] or meta.get("configured") is False, asset  # text_latents off reads nothing
        for key in PLOTTED.get(asset, []):
            assert type(meta[key]) is float, (asset, key, meta[key])
        for key, value in meta.items():  # no empty markdown table: a header and nothing under it
            assert not (isinstance(value, str) and value.startswith("| ") and value.count("\n") < 2), (asset, key)
    assert seen == set(ALL_ASSETS)
    for source in corpus.catalog.names:  # the counts Dagster shows are the partition's rows
        for asset in ("samples", "buckets", "phashes"):
            rows = read(corpus.root, asset, ["sample_id"], f"source = '{source}'").num_rows
            assert corpus.metadata(asset, source)["dagster/row_count"] == rows, (asset, source)
        mds = corpus.metadata("mds_shards", source)
        assert mds["dagster/row_count"] == read(corpus.root, "mds_index", ["sample_id"], f"source = '{source}'").num_rows
        assert mds["dagster/uri"] == str(corpus.root / "mds" / source)
        raw = corpus.metadata("raw_source", source)
        assert raw["size"] == human_bytes(raw["bytes"]) and raw["dagster/uri"] == corpus.catalog.get(source).uri
        # the source's records: every one a sample or a samples reject
        assert raw["dagster/row_count"] == corpus.table("samples", ["sample_id"], filter=f"source = '{source}'").num_rows \
            + corpus.table("rejects", ["sample_id"], filter=f"source = '{source}' AND stage = 'samples'").num_rows, source
    assert corpus.metadata("duplicates", None)["dagster/row_count"] == read(corpus.root, "duplicates", ["sample_id"]).num_rows


def test_sizes_and_durations_read_as_people_write_them() -> None:
    assert (human_bytes(512), human_bytes(1536), human_bytes(int(1.2 * 2**30))) == ("512 B", "1.5 KiB", "1.2 GiB")
    assert (human_seconds(4.21), human_seconds(65), human_seconds(3725)) == ("4.2 s", "1m 05s", "1h 02m 05s")


# -- a two-source corpus on a fresh instance -------------------------------------------------------------

def two_sources(folder: Path) -> Path:
    """`clean` (three photos) and `noisy` (one photo among three files that are not images): the
    noisy source fails `samples_reject_reasons` (more than half refused), the clean one passes."""
    rng = np.random.default_rng(3)
    for name, bad in (("clean", 0), ("noisy", 3)):
        images = folder / name / "part_0"
        images.mkdir(parents=True)
        for i in range(3 if not bad else 1):
            Image.fromarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)).save(images / f"p{i}.jpg", quality=90)
            (images / f"p{i}.txt").write_text(f"A noise picture, number {i}")
        for i in range(bad):
            (images / f"junk{i}.jpg").write_bytes(b"not an image at all " * (i + 1))
    catalog = folder / "sources.yaml"
    catalog.write_text(yaml.safe_dump({"sources": [{"name": n, "format": "imagefolder", "uri": n} for n in ("clean", "noisy")]}))
    return catalog


@pytest.fixture(scope="module")
def small(ray_session, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("conventions")
    catalog = two_sources(folder / "src")
    resources = build_resources(make_settings(folder / "root", catalog))
    instance = fresh_instance(load_catalog(catalog))
    results = {"clean": materialize(resources, CHAIN, "clean", instance),  # noisy: only what its checks need
               "noisy": materialize(resources, CHAIN[:3], "noisy", instance)}
    assert all(r.success for r in results.values()), {s: r.success for s, r in results.items()}
    return {"root": folder / "root", "catalog": catalog, "resources": resources, "instance": instance}


def stale_status(small, asset: str, partition: str) -> StaleStatus:
    defs = dg.Definitions(assets=build_assets(small["resources"]), resources=small["resources"])
    graph = defs.resolve_asset_graph()
    view = AssetGraphView(temporal_context=TemporalContext(effective_dt=get_current_datetime(), last_event_id=None),
                          instance=small["instance"], asset_graph=graph)
    resolver = CachingStaleStatusResolver(instance=small["instance"], asset_graph=graph, loading_context=view)
    return resolver.get_status(dg.AssetKey(asset), partition)


def latest_data_version(instance: dg.DagsterInstance, asset: str, partition: str) -> str:
    record = instance.get_latest_data_version_record(dg.AssetKey(asset), is_source=False, partition_key=partition)
    return record.event_log_entry.asset_materialization.tags["dagster/data_version"]


def test_an_idempotent_rerun_leaves_everything_downstream_fresh(small) -> None:
    """`samples` and `buckets` rerun on an unchanged source: new Lance versions (a real rewrite),
    the same data versions, so `captions` and `mds_shards` stay fresh."""
    instance, root, rerun = small["instance"], small["root"], ["samples", "buckets"]
    before = {a: latest_data_version(instance, a, "clean") for a in rerun}
    assert [stale_status(small, a, "clean") for a in ("captions", "mds_shards")] == [StaleStatus.FRESH] * 2
    versions = {a: version_of(root, a) for a in rerun}
    assert force_next_run(Storage(str(root)), "samples", "clean")  # a real rewrite, not the unchanged-source no-op
    assert materialize(small["resources"], rerun, "clean", instance).success
    assert all(version_of(root, a) > versions[a] for a in rerun), versions
    assert {a: latest_data_version(instance, a, "clean") for a in rerun} == before
    for asset in ("samples", "buckets", "captions", "mds_shards"):
        assert stale_status(small, asset, "clean") == StaleStatus.FRESH, asset
    # the control: a changed source does mark what reads it stale
    extra = Path(small["catalog"]).parent / "clean" / "part_0" / "p9.jpg"
    Image.fromarray(np.zeros((480, 640, 3), dtype=np.uint8)).save(extra)
    assert materialize(small["resources"], ["raw_source"], "clean", instance).success
    assert stale_status(small, "samples", "clean") == StaleStatus.STALE
    assert stale_status(small, "samples", "noisy") == StaleStatus.FRESH


def test_each_partition_shows_its_own_check_result(small) -> None:
    instance = small["instance"]
    key = dg.AssetCheckKey(dg.AssetKey("samples"), "samples_reject_reasons")
    infos = {i.partition_key: i.latest_execution_status
             for i in instance.event_log_storage.get_asset_check_partition_info([key])}
    assert infos == {"clean": AssetCheckExecutionRecordStatus.SUCCEEDED, "noisy": AssetCheckExecutionRecordStatus.FAILED}
    blocking = dg.AssetCheckKey(dg.AssetKey("buckets"), "buckets_in_trainer_set")
    assert {i.partition_key for i in instance.event_log_storage.get_asset_check_partition_info([blocking])} == {
        "clean", "noisy"}
