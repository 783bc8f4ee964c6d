"""Source readers: the demo sources read back the same through the pipeline's readers as through
plain pyarrow/tarfile/os (conftest), locally, from a Lance table and from S3 over HTTP."""

from __future__ import annotations

from pathlib import Path

import lance
import pyarrow as pa
import pytest

from prx_core.demo import load_manifest
from prx_core.sources.catalog import SourceSpec, load_catalog
from prx_core.sources.readers import RECORD_SCHEMA, list_fragments, read_fragment, read_source


def records(spec: SourceSpec, storage_options: dict | None = None) -> dict[str, tuple[bytes, str | None, object]]:
    out = {}
    for batch in read_source(spec, storage_options):
        assert batch.schema == RECORD_SCHEMA
        for row in batch.to_pylist():
            assert row["source_key"] not in out, "duplicate key"
            out[row["source_key"]] = (row["image"], row["caption"], row["embedding"])
    return out


def expected(demo_files, source: str) -> dict[str, tuple[bytes, str]]:
    return {key: value for (name, key), value in demo_files.items() if name == source}


@pytest.mark.parametrize("source", ["stock_photos", "web_images", "crawl_wds"])
def test_demo_sources_read_back_whole(demo_dir: Path, demo_files, source: str) -> None:
    spec = load_catalog(demo_dir / "sources.yaml").get(source)
    got = records(spec)
    want = expected(demo_files, source)
    by_basename = {key.rsplit("/", 1)[-1]: value for key, value in got.items()}
    assert len(got) == len(want) == sum(s.source == source for s in load_manifest(demo_dir).samples)
    for key, (data, caption) in want.items():
        assert by_basename[key][:2] == (data, caption)
    if spec.embedding_column:
        assert sum(v[2] is not None for v in got.values()) >= len(got) - 2  # undecodable rows have none
        assert all(len(v[2]) == 512 for v in got.values() if v[2] is not None)


def test_fragments_partition_the_source(demo_dir: Path) -> None:
    spec = load_catalog(demo_dir / "sources.yaml").get("crawl_wds")
    fragments = list_fragments(spec)
    assert len(fragments) >= 2 and fragments == sorted(fragments)
    keys = [k for f in fragments for b in read_fragment(spec, f) for k in b.column("source_key").to_pylist()]
    assert len(keys) == len(set(keys)) == len(records(spec))


def test_lance_source(tmp_path: Path, demo_dir: Path, demo_files) -> None:
    parquet = load_catalog(demo_dir / "sources.yaml").get("stock_photos")
    table = pa.Table.from_batches(list(read_source(parquet)))
    uri = str(tmp_path / "photos.lance")
    table = table.select(["source_key", "image", "caption", "embedding"])
    lance.write_dataset(table.rename_columns(["k", "img", "alt", "clip"]), uri, max_rows_per_file=50)
    spec = SourceSpec("photos_lance", "lance", uri, image_column="img", caption_column="alt", key_column="k",
                      embedding_column="clip")
    assert len(list_fragments(spec)) >= 2
    assert records(spec) == records(parquet)


def test_parquet_without_key_column_uses_file_and_row(demo_dir: Path) -> None:
    spec = load_catalog(demo_dir / "sources.yaml").get("stock_photos")
    keyless = SourceSpec("x", "parquet", spec.uri, image_column="image")
    keys = list(records(keyless))
    assert keys[0] == "part-00000:0" and len(keys) == len(set(keys))


def test_missing_column_is_a_clear_error(demo_dir: Path) -> None:
    spec = load_catalog(demo_dir / "sources.yaml").get("stock_photos")
    bad = SourceSpec("x", "parquet", spec.uri, image_column="pixels")
    with pytest.raises(KeyError, match="source 'x'.*no column.*pixels"):
        list(read_source(bad))


def test_webdataset_sample_without_image_is_kept(tmp_path: Path) -> None:
    import io
    import tarfile

    with tarfile.open(tmp_path / "s.tar", "w") as tar:
        for name, payload in (("a.txt", b"caption only"), ("b.jpg", b"\xff\xd8\xff"), ("b.txt", b"b caption")):
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    got = records(SourceSpec("w", "webdataset", str(tmp_path)))
    assert got["a"] == (b"", "caption only", None)  # kept: decode rejects it as empty
    assert got["b"][1] == "b caption"


def test_sources_on_s3(s3_endpoint: dict, demo_dir: Path, tmp_path: Path) -> None:
    """Every format read from s3:// over HTTP gives the same records as from the local copy."""
    import s3fs

    options = s3_endpoint["storage_options"]
    import boto3

    boto3.client("s3", endpoint_url=s3_endpoint["endpoint"], region_name="us-east-1",
                 aws_access_key_id="testing", aws_secret_access_key="testing").create_bucket(Bucket="sources")
    fs = s3fs.S3FileSystem(**options)
    catalog = load_catalog(demo_dir / "sources.yaml")
    for spec in catalog.sources:
        fs.put(spec.uri, f"sources/{spec.name}", recursive=True)
        remote = SourceSpec.from_dict({**spec.to_dict(), "uri": f"s3://sources/{spec.name}"})
        local_records = {k.rsplit("/", 1)[-1]: v for k, v in records(spec).items()}
        remote_records = {k.rsplit("/", 1)[-1]: v for k, v in records(remote, options).items()}
        assert remote_records == local_records, spec.name
    parquet = catalog.get("stock_photos")
    table = pa.Table.from_batches(list(read_source(parquet)))
    from prx_core.store.storage import lance_storage_options

    lance.write_dataset(table, "s3://sources/photos.lance", storage_options=lance_storage_options(options))
    spec = SourceSpec("photos_lance", "lance", "s3://sources/photos.lance", image_column="image",
                      caption_column="caption", key_column="source_key", embedding_column="embedding")
    assert records(spec, options) == records(parquet)
