"""The same definitions on a multi-node Ray cluster with the corpus on S3, chosen by
configuration alone.

A head (no CPUs, so no work can run there) and two worker nodes of one CPU each run on this
machine through Ray's own `ray.cluster_utils.Cluster`; `prx-corpus build --config` with
`ray: {address: ..., jobs_address: ...}` and a corpus root on the loopback S3 endpoint builds one
demo source on it, every stage submitted as a Ray job to the head's job server through Dagster
Pipes (every node reads its credentials from its own environment). An embedded-Ray build of the
same source on local files, with the same unit sizes, is the reference: every table's rows and
every MDS byte must agree. The reference builds only what those are made from (REFERENCE): the
labels, embeddings, duplicates, skip-lists and explorer write none of them.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import boto3
import dagster as dg
import pytest
import yaml
from ray_clusters import ray_cluster_with_jobs
from test_build import cli_env

from prx_core.store import lance_io
from prx_core.store.partitions import source_predicate
from prx_core.store.storage import Storage

pytestmark = pytest.mark.slow

CLI = str(Path(sys.executable).with_name("prx-corpus"))
SOURCE = "web_images"
# Small units so that every unit-based stage has several units to spread over the nodes.
UNITS = {"samples_bytes": 400000, "buckets_rows": 16, "phashes_rows": 16, "mds_route_rows": 16, "mds_chunk_rows": 16}
TABLES = ("samples", "rejects", "phashes", "buckets", "mds_index")
ASSETS = ("samples", "buckets", "phashes", "captions", "caption_labels", "caption_embeddings", "mds_shards",
          "duplicates", "skip_lists")
# TABLES and the MDS streams, and what they read (mds_shards runs after buckets, captions and text_latents)
REFERENCE = ("raw_source", "samples", "buckets", "phashes", "captions", "text_latents", "mds_shards")


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, str]]:
    with ray_cluster_with_jobs(head_cpus=0, worker_nodes=2) as settings:
        yield settings


def build(demo_dir: Path, out: Path, root: str, config: dict, *select: str) -> subprocess.CompletedProcess[str]:
    """`prx-corpus build` of SOURCE under `config`: every asset, or those in `select`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(config))
    env = cli_env()  # an embedded build must not join a cluster an earlier test left in RAY_ADDRESS
    return subprocess.run(
        [CLI, "build", "--sources", str(demo_dir / "sources.yaml"), "--root", root, "--source", SOURCE,
         "--config", str(out / "config.yaml"), "--dagster-home", str(out / "dagster"),
         *(["--select", ",".join(select)] if select else [])],
        capture_output=True, text=True, timeout=900, env=env)


def mds_bytes(storage: Storage) -> dict[str, str]:
    """Every file of the source's MDS streams, by path under its folder, as a SHA-256."""
    fs, folder = storage.filesystem(), storage.uri("mds", SOURCE).split("://")[-1]
    return {path.split(folder, 1)[1]: hashlib.sha256(fs.cat_file(path)).hexdigest() for path in sorted(fs.find(folder))}


def last_metadata(home: Path, asset: str) -> dict[str, dg.MetadataValue]:
    instance = dg.DagsterInstance.from_config(str(home))
    return dict(instance.fetch_materializations(dg.AssetKey(asset), limit=1).records[0].asset_materialization.metadata)


def ray_nodes(home: Path, asset: str) -> int:
    """The most Ray nodes any phase of the asset's last materialization ran its units on."""
    ops = last_metadata(home, asset)["ops"].value  # the operational counters, one JSON entry
    return max(int(v) for k, v in ops.items() if k.endswith("ray_nodes"))


def run_log_lines(home: Path) -> list[str]:
    instance = dg.DagsterInstance.from_config(str(home))
    return [entry.user_message for run in instance.get_runs() for entry in instance.all_logs(run.run_id)]


def test_the_graph_runs_on_a_multi_node_cluster_and_equals_an_embedded_run(
        cluster: str, demo_dir: Path, tmp_path: Path, s3_endpoint: dict) -> None:
    options = s3_endpoint["storage_options"]
    s3 = Storage("s3://cluster-corpus/corpus", options)
    boto3.client("s3", endpoint_url=s3_endpoint["endpoint"], region_name="us-east-1").create_bucket(Bucket="cluster-corpus")
    local = Storage(str(tmp_path / "embedded" / "corpus"))
    config = {"units": UNITS, "storage": {"storage_options": options}}
    on_cluster = build(demo_dir, tmp_path / "cluster", s3.root, {**config, "ray": cluster})
    assert on_cluster.returncode == 0, on_cluster.stdout[-3000:] + on_cluster.stderr[-3000:]
    assert f"ray cluster {cluster['address']}" in on_cluster.stdout
    embedded = build(demo_dir, tmp_path / "embedded", local.root, {"units": UNITS}, *REFERENCE)
    assert embedded.returncode == 0, embedded.stdout[-3000:] + embedded.stderr[-3000:]

    # work ran on both worker nodes (the head has no CPUs)
    home = tmp_path / "cluster" / "dagster"
    nodes = {a: ray_nodes(home, a) for a in ("samples", "buckets", "phashes", "mds_shards")}
    assert min(nodes.values()) >= 1 and max(nodes.values()) == 2, nodes

    # every stage ran as its own Ray job; its progress lines came back through Pipes into the run logs
    jobs = {a: str(last_metadata(home, a)["ray_job_id"].value) for a in ASSETS}
    assert all(job.startswith("pipes-") for job in jobs.values()) and len(set(jobs.values())) == len(ASSETS), jobs
    logs = run_log_lines(home)
    assert any(line.startswith(f"samples[{SOURCE}]: ") and "units" in line for line in logs)
    assert any(line.startswith("samples: Ray job on 3 node(s)") for line in logs)

    for table in TABLES:
        on_s3 = lance_io.partition_digest(s3.lance_uri(table), source_predicate(SOURCE),
                                           storage_options=s3.lance_storage_options())
        assert on_s3 == lance_io.partition_digest(local.lance_uri(table), source_predicate(SOURCE)), table
    cluster_mds = mds_bytes(s3)
    assert cluster_mds and cluster_mds == mds_bytes(local)
