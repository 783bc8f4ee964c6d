"""The S3 endpoint going down and coming back in the middle of `samples`, `mds_shards` and
`skip_lists` (a real local Ray, real Lance on moto's loopback S3 behind a proxy the test takes
down): the run retries or fails naming the problem, no stream is ever half visible, and a rerun
leaves exactly the rows, streams and skip-lists of a clean run."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import threading
from pathlib import Path

import boto3
import pyarrow as pa
import pytest
from s3_proxy import Proxy
from test_mds_stage import CAPTIONER
from test_resume import parquet_source

from prx_core.sources.catalog import SourceSpec
from prx_core.stages.mds_shards.stage import build_mds
from prx_core.stages.samples.stage import build_samples
from prx_core.stages.skip_lists.stage import SkipPolicy, build_skip_lists
from prx_core.store import lance_io, schemas
from prx_core.store.partitions import rejects_predicate, source_predicate
from prx_core.store.storage import Storage

POLICY = SkipPolicy(opt_out=("k0000", "k0001", "k0104"))
DOWN_SECONDS = 4.0
STREAM_INDEX = r"/corpus/mds/photos/\d+/\d+x\d+/index\.json$"  # a stream's, not a chunk's


@pytest.fixture()
def s3(s3_endpoint: dict, ray_cluster, request: pytest.FixtureRequest):
    """A fresh bucket; the proxy in front of moto; boto3 straight to moto (the test's own view)."""
    port = int(s3_endpoint["endpoint"].rsplit(":", 1)[1])
    proxy = Proxy(("127.0.0.1", port))
    client = boto3.client("s3", endpoint_url=s3_endpoint["endpoint"], region_name="us-east-1")
    bucket = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:50].strip("-")
    client.create_bucket(Bucket=bucket)
    yield proxy, client, bucket
    proxy.stop()


def storage_for(proxy: Proxy, bucket: str) -> Storage:
    return Storage(f"s3://{bucket}/corpus", {"client_kwargs": {"endpoint_url": proxy.endpoint, "region_name": "us-east-1"}})


def objects(client, bucket: str, prefix: str) -> dict[str, bytes]:
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"corpus/{prefix}"):
        for item in page.get("Contents", []):
            out[item["Key"][len("corpus/"):]] = client.get_object(Bucket=bucket, Key=item["Key"])["Body"].read()
    return out


def local_objects(root: str, prefix: str) -> dict[str, bytes]:
    base = Path(root)
    return {p.relative_to(base).as_posix(): p.read_bytes() for p in sorted((base / prefix).rglob("*")) if p.is_file()}


def visible_streams(files: dict[str, bytes]) -> dict[str, dict[str, str]]:
    """Per published stream (its index.json): every file the index references, with its digest;
    a referenced shard missing or of another size than the index says fails here (half visible)."""
    out = {}
    for name, data in files.items():
        if not re.fullmatch(r"mds/photos/\d+/\d+x\d+/index\.json", name):
            continue
        folder = name.rsplit("/", 1)[0]
        stream = {"index.json": hashlib.sha256(data).hexdigest()}
        for shard in json.loads(data)["shards"]:
            path = f"{folder}/{shard['raw_data']['basename']}"
            assert path in files, f"{name} references {path}, which is not there"
            assert len(files[path]) == shard["raw_data"]["bytes"], f"{path} is incomplete"
            stream[shard["raw_data"]["basename"]] = hashlib.sha256(files[path]).hexdigest()
        out[folder] = stream
    return out


def skip_files(files: dict[str, bytes]) -> dict[str, str]:
    return {k: hashlib.sha256(v).hexdigest() for k, v in files.items() if k.startswith("skiplists/")}


def tables(storage: Storage) -> dict[str, str]:
    options = storage.lance_storage_options()
    out = {"samples": lance_io.partition_digest(storage.lance_uri("samples"), source_predicate("photos"),
                                               storage_options=options)}
    for stage in ("samples", "mds_shards"):
        if lance_io.table_exists(storage.lance_uri("rejects"), options):
            out[f"rejects:{stage}"] = lance_io.partition_digest(storage.lance_uri("rejects"), rejects_predicate("photos", stage),
                                                                storage_options=options)
    if lance_io.table_exists(storage.lance_uri("mds_index"), options):
        out["mds_index"] = lance_io.partition_digest(storage.lance_uri("mds_index"), source_predicate("photos"),
                                                     storage_options=options)
    return out


def add_captions(storage: Storage) -> None:
    """A caption for every sample (test_mds_stage's helper, with the storage's options)."""
    options = storage.lance_storage_options()
    samples = lance_io.read_table(storage.lance_uri("samples"), ["content_id"], storage_options=options)
    rows = [{"content_id": c, "captioner_version": CAPTIONER, "captioner_id": "source", "prompt_version": "p",
             "caption": f"a picture {c[:8]}", "word_count": 3, "error": ""}
            for c in sorted(set(samples["content_id"].to_pylist()))]
    lance_io.upsert(storage.lance_uri("captions"), pa.Table.from_pylist(rows, schema=schemas.CAPTIONS),
                    ["content_id", "captioner_version"], options)


def run_stage(stage: str, spec: SourceSpec, storage: Storage):
    if stage == "samples":
        return build_samples(spec, storage, unit_bytes=1)
    if stage == "mds_shards":
        return build_mds("photos", storage, CAPTIONER, route_rows=7, chunk_rows=3)
    return build_skip_lists("photos", storage, CAPTIONER, "lab-v1", POLICY)


def build_until(stage: str, spec: SourceSpec, storage: Storage) -> None:
    """Every stage before `stage`, undisturbed."""
    for before in ("samples", "mds_shards", "skip_lists"):
        if before == stage:
            return
        run_stage(before, spec, storage)
        if before == "samples":
            add_captions(storage)


# stage -> (request method, path pattern): the request at which the endpoint goes down
FAULTS = {
    "samples": ("PUT", r"/corpus/_runs/samples/photos/[0-9a-f]+/done/u000002\.json"),
    "mds_shards": ("PUT", STREAM_INDEX),
    "skip_lists": ("PUT", r"/corpus/skiplists/photos/.*\.skip$"),
}


@pytest.mark.parametrize("stage", list(FAULTS))
def test_the_endpoint_going_down_mid_stage(stage: str, s3, tmp_path: Path) -> None:
    proxy, client, bucket = s3
    spec = parquet_source(tmp_path / "source", files=3, rows=4)
    storage = storage_for(proxy, bucket)
    build_until(stage, spec, storage)

    seen: list[dict] = []

    def go_down(proxy: Proxy, method: str, path: str, _client) -> bool:
        # what a reader sees at the moment the endpoint fails: every published stream whole
        seen.append(visible_streams(objects(client, bucket, "mds/")))
        proxy.down_for(DOWN_SECONDS)
        return True  # this request is lost with the endpoint

    proxy.watch(*FAULTS[stage], go_down)
    try:
        run_stage(stage, spec, storage)
    except Exception as exc:  # failing is allowed, but clearly: what failed and why
        text = f"{type(exc).__name__}: {exc}"
        assert re.search(r"connect|endpoint|timed? ?out|reset|refused|unavailable|Errno", text, re.I), text
        threading.Event().wait(DOWN_SECONDS)
        run_stage(stage, spec, storage)  # the rerun
    assert seen, "the fault never happened"

    clean = Storage(str(tmp_path / "clean"))
    build_until(stage, spec, clean)
    run_stage(stage, spec, clean)
    got = objects(client, bucket, "")
    assert tables(storage) == tables(clean)
    assert visible_streams(got) == visible_streams(local_objects(clean.root, "mds"))
    assert skip_files(got) == skip_files(local_objects(clean.root, "skiplists"))
    shutil.rmtree(clean.root)
