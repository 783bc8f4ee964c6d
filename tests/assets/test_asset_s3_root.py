"""The whole graph with the corpus root AND the source on S3 (a real moto endpoint on loopback):
nothing may assume a local disk."""

from __future__ import annotations

from pathlib import Path

import boto3
import dagster as dg
import pyarrow.compute as pc
import yaml
from materializing import make_settings

from prx_cli.build import run_build
from prx_assets.common import sync_partitions
from prx_assets.definitions import build_definitions
from prx_core.shards.mds.read import verify_stream
from prx_core.shards.mds.streams import list_streams
from prx_core.shards.skiplists.files import read_skip_lists
from prx_core.sources.catalog import load_catalog
from prx_core.store import lance_io
from prx_core.store.storage import Storage


def upload(folder: Path, bucket: str, prefix: str, client) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(folder)}")


def test_a_source_on_s3_builds_into_a_root_on_s3(ray_session, demo_dir: Path, s3_endpoint: dict, tmp_path: Path) -> None:
    options = s3_endpoint["storage_options"]
    client = boto3.client("s3", endpoint_url=s3_endpoint["endpoint"], region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    for bucket in ("prx-sources", "prx-corpus"):
        client.create_bucket(Bucket=bucket)
    upload(demo_dir / "crawl_wds", "prx-sources", "crawl_wds", client)
    catalog_path = tmp_path / "sources.yaml"
    catalog_path.write_text(yaml.safe_dump({"sources": [
        {"name": "crawl_wds", "format": "webdataset", "uri": "s3://prx-sources/crawl_wds"}]}))
    root = "s3://prx-corpus/prx"
    settings = make_settings(root, catalog_path, {"storage": {"storage_options": options}})
    defs = build_definitions(settings)
    catalog = load_catalog(catalog_path)
    instance = dg.DagsterInstance.ephemeral()
    sync_partitions(instance, catalog)
    log: list[str] = []
    outcome = run_build(defs, instance, catalog.names, None, None, echo=lambda *a, **k: log.append(" ".join(map(str, a))))
    assert outcome.ok, (outcome.failed_runs, outcome.failed_blocking, log)

    store = Storage(root, options)
    lance_options = store.lance_storage_options()
    samples = lance_io.read_table(store.lance_uri("samples"), ["sample_id"], storage_options=lance_options)
    assert samples.num_rows == 113 and pc.count_distinct(samples["sample_id"]).as_py() == 113
    assert lance_io.read_table(store.lance_uri("rejects"), ["reason"], storage_options=lance_options).num_rows == 7
    index = lance_io.read_table(store.lance_uri("mds_index"), storage_options=lance_options)
    streams = list_streams(root, "crawl_wds", options)
    assert streams and all(uri.startswith("s3://prx-corpus/prx/mds/crawl_wds/") for uri in streams)
    assert sum(verify_stream(uri, options).count for uri in streams) == index.num_rows == 107
    skips = read_skip_lists(root, "crawl_wds", options)
    # the planted duplicates' other members live in the other demo sources, not built here
    assert {s.reason for s in skips} == {"text"} and sum(len(s.indices) for s in skips) == 4
    assert outcome.metadata[("mds_shards", "crawl_wds")]["samples_written"] == 107
    assert not (Path.cwd() / "prx-corpus").exists()  # nothing landed on a local path named like the bucket
