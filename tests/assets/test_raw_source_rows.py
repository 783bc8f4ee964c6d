"""`raw_source` reports `dagster/row_count` like every other asset (issue 43): the source's
records, told without reading an image (`prx_core.sources.row_counts`: Lance and parquet metadata,
an image folder's image files, local tar headers and Arrow batch headers), equal to what the
readers yield for every demo source, planted non-images, truncated files and all. A gzipped tar
would be read whole to count it: no row count, and an entry saying why. Also: raw_source's kinds
stay within three tags whatever the catalog mixes."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import lance
import pyarrow as pa
import pytest
import yaml
from materializing import fresh_instance, make_settings, materialize, materialized

from prx_assets.definitions import build_definitions, build_resources
from prx_core.sources.catalog import load_catalog, parse_catalog
from prx_core.sources.readers import fragment_sizes, list_fragments, observe_source, read_fragment
from prx_core.sources.row_counts import source_rows

JPEG = bytes.fromhex("ffd8ffe000104a46494600") + b"\0" * 32


def records(spec) -> int:
    return sum(batch.num_rows for fragment in list_fragments(spec) for batch in read_fragment(spec, fragment))


def test_every_demo_source_counts_what_its_reader_yields(demo_dir: Path) -> None:
    for spec in load_catalog(demo_dir / "sources.yaml").sources:
        assert observe_source(spec)["rows"] == records(spec) > 0, spec.name


def test_lance_arrow_and_tar_sources(tmp_path: Path) -> None:
    lance.write_dataset(pa.table({"image": [JPEG] * 5}), str(tmp_path / "photos.lance"))
    (tmp_path / "saved").mkdir()
    with pa.OSFile(str(tmp_path / "saved" / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, pa.schema([("image", pa.binary())])) as writer:
            for _ in range(3):
                writer.write_table(pa.table({"image": [JPEG] * 4}))
    for name, gz in (("plain", False), ("packed", True)):
        (tmp_path / name).mkdir()
        with tarfile.open(tmp_path / name / ("0.tar.gz" if gz else "0.tar"), "w:gz" if gz else "w") as tar:
            for member, data in (("k0.jpg", JPEG), ("k0.txt", b"a"), ("k1.png", JPEG), ("k2.txt", b"no image")):
                info = tarfile.TarInfo(member)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    entries = [{"name": "db", "format": "lance", "uri": "photos.lance", "image_column": "image"},
               {"name": "saved", "format": "huggingface", "uri": "saved", "image_column": "image"},
               {"name": "plain", "format": "webdataset", "uri": "plain"},
               {"name": "packed", "format": "webdataset", "uri": "packed"}]
    specs = {s.name: s for s in parse_catalog({"sources": entries}, base_dir=tmp_path).sources}
    counted = {name: source_rows(spec, fragment_sizes(spec), None) for name, spec in specs.items()}
    assert counted == {"db": 5, "saved": 12, "plain": 2, "packed": None}
    assert counted["saved"] == records(specs["saved"])


def test_the_materialization_carries_it(demo_dir: Path, tmp_path: Path) -> None:
    catalog = tmp_path / "sources.yaml"
    mixed = yaml.safe_load((demo_dir / "sources.yaml").read_text())
    for entry in mixed["sources"]:
        entry["uri"] = str(demo_dir / entry["uri"])
    catalog.write_text(yaml.safe_dump(mixed))
    settings = make_settings(tmp_path / "corpus", catalog)
    resources = build_resources(settings)
    instance = fresh_instance(load_catalog(catalog))
    for spec in load_catalog(catalog).sources:
        result = materialize(resources, ["raw_source"], spec.name, instance)
        assert result.success
        meta = materialized(result)["raw_source"]
        assert meta["dagster/row_count"] == observe_source(spec)["rows"], spec.name
    # four formats on the local disk: the Catalog's list shows where they are, not five tags
    graph = build_definitions(settings).resolve_asset_graph()
    kinds = {k.to_user_string(): set(graph.get(k).kinds) for k in graph.get_all_asset_keys()}
    assert kinds["raw_source"] == {"filesystem"} and all(len(v) <= 3 for v in kinds.values()), kinds
    one = tmp_path / "one.yaml"
    one.write_text(yaml.safe_dump({"sources": [e for e in mixed["sources"] if e["format"] == "parquet"]}))
    graph = build_definitions(make_settings(tmp_path / "corpus", one)).resolve_asset_graph()
    assert set(graph.get(next(k for k in graph.get_all_asset_keys() if k.to_user_string() == "raw_source")).kinds) == {
        "filesystem", "parquet"}


@pytest.mark.parametrize("asset", ["mds_shards", "skip_lists"])
def test_descriptions_render_paths_as_written(demo_dir: Path, tmp_path: Path, asset: str) -> None:
    """Markdown (the UI renders descriptions as Markdown) takes `<root>` for an HTML tag and drops
    it: every placeholder sits in a code span."""
    import re

    graph = build_definitions(make_settings(tmp_path / "corpus", demo_dir / "sources.yaml")).resolve_asset_graph()
    for key in graph.get_all_asset_keys():
        text = re.sub(r"`[^`]*`", "", graph.get(key).description or "")
        assert not re.search(r"<[A-Za-z/!?]", text), (key.to_user_string(), text)
    node = graph.get(next(k for k in graph.get_all_asset_keys() if k.to_user_string() == asset))
    assert "`<root>/" in node.description
