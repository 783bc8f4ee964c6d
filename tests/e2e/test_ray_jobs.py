"""Terminating a run in Dagster stops the Ray job running its stage.

Dagster as deployed (deployment.py: deploy/dagster.yaml on PostgreSQL, code server, daemon,
webserver) with `ray: {jobs_address: ...}` pointing at a real local Ray head and its job server.
The `samples` job is held just before its commit (PRX_PAUSE_AT in the job's runtime_env, a named
pause point of prx_core.compute.faults); the run is terminated through the webserver's GraphQL
API, which is what the UI's Terminate button calls. The Ray job must end STOPPED, the run
CANCELED, and nothing be committed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest
import yaml
from deployment import deployment
from postgres_server import postgres_server
from ray_clusters import ray_cluster_with_jobs

from prx_core.compute.faults import MARKER
from prx_core.store import lance_io
from prx_core.store.storage import Storage

pytestmark = pytest.mark.slow

SOURCE, PAUSE = "web_images", "samples:before_commit"


@pytest.fixture(scope="module")
def ray_head() -> Iterator[dict[str, str]]:
    with ray_cluster_with_jobs(head_cpus=2) as settings:
        yield settings


def paused_job(client: object) -> str | None:
    """The submission id of a `samples` job that reached the pause point, if any."""
    for job in client.list_jobs():  # type: ignore[attr-defined]
        if (job.metadata or {}).get("prx_stage") == "samples" and job.status == "RUNNING" \
                and f"{MARKER} {PAUSE}" in client.get_job_logs(job.submission_id):  # type: ignore[attr-defined]
            return job.submission_id
    return None


def test_terminating_the_run_stops_its_ray_job(ray_head: dict[str, str], demo_dir: Path, tmp_path: Path) -> None:
    from ray.job_submission import JobStatus, JobSubmissionClient

    root = tmp_path / "corpus"
    config = tmp_path / "prx.yaml"
    config.write_text(yaml.safe_dump({"ray": {**ray_head, "job_poll_seconds": 0.5,
                                              "job_runtime_env": {"env_vars": {"PRX_PAUSE_AT": PAUSE}}}}))
    env = {"PRX_ROOT": str(root), "PRX_SOURCES": str(demo_dir / "sources.yaml"), "PRX_CONFIG": str(config)}
    jobs = JobSubmissionClient(ray_head["jobs_address"])
    with postgres_server() as pg, deployment(pg, tmp_path, env) as deployed:
        deployed.instance.add_dynamic_partitions("sources", [SOURCE])
        run_id = deployed.submit(["samples"], SOURCE)
        job_id = deployed.wait_for("the samples Ray job to reach its pause point", lambda: paused_job(jobs), 300)
        # the job holds the partition lock in the Dagster run's name (another run's error names it)
        lock = json.loads((root / "_locks" / "samples" / f"{SOURCE}.lock").read_text())
        assert lock["run"] == f"dagster run {run_id}", lock

        deployed.client.terminate_run(run_id)  # the UI's Terminate button

        deployed.wait_for(f"Ray job {job_id} to stop", lambda: jobs.get_job_status(job_id) == JobStatus.STOPPED, 120)
        (run,) = deployed.wait_for_runs([run_id], 120)
        assert run.status == dg.DagsterRunStatus.CANCELED, deployed.logs()
        messages = [e.user_message for e in deployed.instance.all_logs(run_id)]
        assert any(f"Will terminate RayJob {job_id}" in m for m in messages), messages[-20:]
        assert any(m.startswith(f"samples[{SOURCE}]: ") for m in messages), "job progress came back through Pipes"

    # held before the commit, then stopped: no table version was written
    assert not lance_io.table_exists(Storage(str(root)).lance_uri("samples"))
