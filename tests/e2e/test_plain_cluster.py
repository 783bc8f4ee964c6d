"""An existing Ray cluster without Kubernetes or a job server (issue 43, docs/deploy.md "Without
Kubernetes"): `ray: {address: <head>:<port>}` alone, as on a cluster started with `ray start` (by
hand, or by the Slurm recipe deploy/slurm/prx-build.sbatch). A head with no CPUs and two worker
nodes of one CPU each run on this machine (Ray's own `cluster_utils`, the nodes sharing this
machine's disk as a cluster's nodes share a filesystem); `prx-corpus plan` sizes for the cluster and
says so, and `prx-corpus build` connects once as a driver and runs every stage's units on the
workers, in the build's own process (no Ray job). ~3 min on 2 busy cores."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from ray_clusters import ray_cluster_with_jobs
from test_build import cli_env
from test_cluster import UNITS, last_metadata, ray_nodes

pytestmark = pytest.mark.slow

CLI = str(Path(sys.executable).with_name("prx-corpus"))
SOURCE = "web_images"


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    with ray_cluster_with_jobs(head_cpus=0, worker_nodes=2) as settings:
        yield settings["address"]  # the GCS address alone: no job server configured


def test_plan_sizes_for_the_cluster_it_is_pointed_at(address: str, demo_dir: Path, tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"ray": {"address": address}}))
    done = subprocess.run([CLI, "plan", "--sources", str(demo_dir / "sources.yaml"), "--source", SOURCE, "--sample", "20",
                           "--config", str(config), "--json", str(tmp_path / "plan.json")],
                          capture_output=True, text=True, timeout=600, env=cli_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"sizing for the Ray cluster at {address}: 2 cores, 0 GPUs" in done.stdout
    assert json.loads((tmp_path / "plan.json").read_text())["cpus"] == 2


def test_build_runs_on_the_workers_of_a_plain_cluster(address: str, demo_dir: Path, tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"ray": {"address": address}, "units": UNITS}))
    home = tmp_path / "dagster"
    done = subprocess.run([CLI, "build", "--sources", str(demo_dir / "sources.yaml"), "--root", str(tmp_path / "corpus"),
                           "--source", SOURCE, "--config", str(config), "--dagster-home", str(home)],
                          capture_output=True, text=True, timeout=900, env=cli_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"ray cluster {address}" in done.stdout
    nodes = {a: ray_nodes(home, a) for a in ("samples", "buckets", "phashes", "mds_shards")}
    assert min(nodes.values()) >= 1 and max(nodes.values()) == 2, nodes  # the head has no CPU: both workers worked
    assert "ray_job_id" not in last_metadata(home, "samples")  # in the build's process, over the address
