"""A Ray cluster on this machine with its job server, for the cluster and Ray-job tests.

Every node's dashboard agent gets a free port: the default (52365) is often taken by an embedded
Ray of the same test session, and a head whose agent cannot bind accepts no job ("No available
agent to submit job")."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from postgres_server import free_port

from prx_core.compute.parallel import MAINTENANCE_RESOURCE


@contextmanager
def ray_cluster_with_jobs(head_cpus: int, worker_nodes: int = 0) -> Iterator[dict[str, str]]:
    """Yield the `ray:` settings that reach it: GCS address, job server, the Python jobs run with."""
    import ray
    from ray.cluster_utils import Cluster

    # A Ray this process is still connected to (tests/assets' session Ray, when test_cluster runs
    # after them in one pytest) lends the cluster its node IP: since the embedded Ray listens on
    # loopback (prx_core.compute.loopback) that is 127.0.0.1 while the cluster's nodes take the
    # host's, and the cluster's job server answered 504. The cluster starts as in a fresh process.
    if ray.is_initialized():
        ray.shutdown()
    port = free_port()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": head_cpus, "include_dashboard": True, "dashboard_host": "127.0.0.1", "dashboard_port": port,
        "dashboard_agent_listen_port": free_port()})
    for _ in range(worker_nodes):  # workers offer prx_maintenance, as deploy/raycluster.yaml's do
        cluster.add_node(num_cpus=1, resources={MAINTENANCE_RESOURCE: 2}, dashboard_agent_listen_port=free_port())
    cluster.wait_for_nodes()
    try:
        yield {"address": cluster.address, "jobs_address": f"http://127.0.0.1:{port}", "job_python": sys.executable}
    finally:
        cluster.shutdown()
