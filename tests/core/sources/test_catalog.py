"""The sources.yaml catalog: valid files load, every invalid field gets an error naming it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from prx_core.sources.catalog import CatalogError, SourceSpec, dump_catalog, load_catalog

VALID = {
    "name": "photos_a",
    "format": "parquet",
    "uri": "data/photos",
    "image_column": "image",
    "caption_column": "caption",
    "key_column": "key",
    "embedding_column": None,
    "weight": 1.0,
}


def write(tmp_path: Path, sources: object) -> Path:
    path = tmp_path / "sources.yaml"
    path.write_text(yaml.safe_dump({"sources": sources}))
    return path


def test_valid_catalog_resolves_relative_uris(tmp_path: Path) -> None:
    wds = {"name": "crawl", "format": "webdataset", "uri": "s3://bucket/crawl", "weight": 2}
    catalog = load_catalog(write(tmp_path, [VALID, wds]))
    assert catalog.names == ["photos_a", "crawl"]
    assert catalog.get("photos_a").uri == str(tmp_path / "data" / "photos")
    assert catalog.get("crawl").uri == "s3://bucket/crawl"
    assert catalog.get("crawl").weight == 2.0
    with pytest.raises(KeyError, match="no source named 'nope'"):
        catalog.get("nope")


def test_dump_then_load_round_trips(tmp_path: Path) -> None:
    specs = [SourceSpec(**{**VALID, "uri": "/abs/photos"}), SourceSpec("web", "imagefolder", "/abs/web", weight=0.5)]
    dump_catalog(specs, tmp_path / "sources.yaml")
    assert list(load_catalog(tmp_path / "sources.yaml").sources) == specs


@pytest.mark.parametrize(
    ("change", "field", "problem"),
    [
        ({"name": "Photos-A"}, "name", "must match"),
        ({"name": None}, "name", "must match"),
        ({"format": "csv"}, "format", "must be one of"),
        ({"uri": ""}, "uri", "required"),
        ({"image_column": None}, "image_column", "required for format parquet"),
        ({"caption_column": 3}, "caption_column", "column name or null"),
        ({"weight": 0}, "weight", "positive number"),
        ({"weight": "heavy"}, "weight", "positive number"),
        ({"weight": float("nan")}, "weight", "positive number"),
        ({"colour": "red"}, "colour", "unknown field"),
        ({"url_column": "URL"}, "url_column", "not both"),
        ({"image_column": None, "download": {"retries": 1}}, "image_column", "or url_column"),
        ({"format": "imagefolder", "image_column": None, "key_column": None, "download": {"retries": 1}}, "download",
         "only for table sources"),
        ({"image_column": None, "url_column": "URL", "download": {"allow_object_prefixes": "s3://b/"}},
         "download.allow_object_prefixes", "must be a list"),
        ({"image_column": None, "url_column": "URL", "download": {"retries": -1}}, "download.retries", "must be like"),
        ({"image_column": None, "url_column": "URL", "download": {"speed": 9}}, "download.speed", "unknown setting"),
        ({"image_column": None, "url_column": "URL", "download": {"honor_opt_out": "yes"}}, "download.honor_opt_out",
         "must be like"),
        ({"metadata_columns": "license"}, "metadata_columns", "list of column names"),
        ({"metadata_columns": ["a", "a"]}, "metadata_columns", "twice"),
        ({"joins": {"uri": "c"}}, "joins", "must be a list"),
        ({"joins": [{"uri": "c", "caption_column": "caption"}]}, "joins[0].key_column", "required"),
        ({"joins": [{"uri": "c", "key_column": "id"}]}, "joins[0]", "joins nothing"),
        ({"joins": [{"uri": "c", "key_column": "id", "caption_column": "t", "format": "csv"}]}, "joins[0].format",
         "must be one of parquet, lance"),
        ({"joins": [{"uri": "c", "key_column": "id", "caption_column": "t", "colour": 1}]}, "joins[0].colour",
         "unknown field"),
        ({"key_column": None, "joins": [{"uri": "c", "key_column": "id", "caption_column": "t"}]}, "key_column",
         "required with joins"),
    ],
)
def test_invalid_field_is_named(tmp_path: Path, change: dict, field: str, problem: str) -> None:
    with pytest.raises(CatalogError) as err:
        load_catalog(write(tmp_path, [{**VALID, **change}]))
    message = str(err.value)
    assert f"field '{field}'" in message and problem in message
    assert "sources.yaml" in message


def test_new_source_forms_load_and_round_trip(tmp_path: Path) -> None:
    """The forms of *Bringing your datasets*: a URL table with download settings, a joined source,
    an HF dataset with its columns left to the features."""
    laion = {"name": "laion", "format": "parquet", "uri": "laion", "url_column": "URL", "caption_column": "TEXT",
             "metadata_columns": ["similarity"], "download": {"per_host": 2, "read_timeout_s": 5}}
    joined = {**VALID, "name": "joined", "joins": [{"uri": "captions", "key_column": "id", "caption_column": "c"},
                                                    {"uri": "clip.lance", "key_column": "id", "embedding_column": "v"}]}
    hf = {"name": "hf", "format": "huggingface", "uri": "hf"}
    catalog = load_catalog(write(tmp_path, [laion, joined, hf]))
    spec = catalog.get("laion")
    assert spec.image_column is None and spec.download.per_host == 2 and spec.download.read_timeout_s == 5.0
    assert spec.download.retries == 3 and spec.metadata_columns == ("similarity",)
    first, second = catalog.get("joined").joins
    assert first.uri == str(tmp_path / "captions") and first.format == "parquet" and second.format == "lance"
    assert catalog.get("hf").image_column is None and catalog.get("hf").is_table
    for source in catalog.sources:
        assert SourceSpec.from_dict(source.to_dict()) == source  # what run manifests carry to workers
    dump_catalog(list(catalog.sources), tmp_path / "again.yaml")
    assert list(load_catalog(tmp_path / "again.yaml").sources) == list(catalog.sources)


def test_error_names_the_source(tmp_path: Path) -> None:
    bad = {"name": "web", "format": "imagefolder", "uri": "x", "embedding_column": "clip"}
    with pytest.raises(CatalogError, match=r"source 'web': field 'embedding_column': not supported"):
        load_catalog(write(tmp_path, [VALID, bad]))


def test_duplicate_names_rejected(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match=r"source 'photos_a': field 'name': duplicate"):
        load_catalog(write(tmp_path, [VALID, VALID]))


@pytest.mark.parametrize("text", ["", "sources: []", "- a\n- b", "sources: [1]", "sources: {a: 1}", "other: 1\nsources: []"])
def test_malformed_documents(tmp_path: Path, text: str) -> None:
    path = tmp_path / "sources.yaml"
    path.write_text(text)
    with pytest.raises(CatalogError):
        load_catalog(path)


def test_missing_file_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match="cannot read catalog"):
        load_catalog(tmp_path / "absent.yaml")
    (tmp_path / "bad.yaml").write_text("sources: [\n")
    with pytest.raises(CatalogError, match="not valid YAML"):
        load_catalog(tmp_path / "bad.yaml")
