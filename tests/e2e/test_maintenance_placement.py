"""Maintenance never lands on the head of a cluster: on a local two-node Ray (a head with a CPU, as
the Slurm recipe's is, and a worker offering `prx_maintenance`, as deploy/raycluster.yaml's do), a
task asking for no CPU lands on the caller's node, the head, while `run_on_worker` (index builds and
merges, compaction, staging indexes) lands on the worker, and a real index build done there
indexes the table."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from prx_core.compute.parallel import MAINTENANCE_RESOURCE, maintenance_placement, run_on_worker
from prx_core.store import lance_io, schemas
from prx_core.store.maintenance import IndexReport
from prx_core.store.partitions import source_predicate, write_partition
from prx_core.store.storage import Storage
from prx_core.upkeep.indexing import index_table

pytestmark = pytest.mark.slow


def node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


@pytest.fixture(scope="module")
def nodes() -> Iterator[dict[str, str]]:
    import ray
    import ray.cloudpickle
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    worker = cluster.add_node(num_cpus=1, resources={MAINTENANCE_RESOURCE: 2})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import test modules
    try:
        yield {"head": cluster.head_node.node_id, "worker": worker.node_id}
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_a_task_asking_for_no_cpu_lands_on_the_head(nodes: dict[str, str]) -> None:
    """The hazard: where a maintenance task went before it asked for the resource."""
    import ray

    assert ray.get(ray.remote(node_id).options(num_cpus=0).remote()) == nodes["head"]


def test_maintenance_lands_on_the_worker(nodes: dict[str, str]) -> None:
    assert maintenance_placement() == {"resources": {MAINTENANCE_RESOURCE: 1}, "memory": 2 << 30}
    assert {run_on_worker(node_id, num_cpus=0) for _ in range(4)} == {nodes["worker"]}


def no_index(uri: str, table: str, options: lance_io.StorageOptions) -> IndexReport:
    """The commit's indexer left out: the test's own `index_table` call builds the indexes."""
    return IndexReport(indexes=[], created=[], optimized=[], notes=[], version=lance_io.table_version(uri, options))


def test_an_index_build_runs_there_and_indexes_the_table(nodes: dict[str, str], tmp_path: Path) -> None:
    storage = Storage(str(tmp_path / "corpus"))
    rows = pa.Table.from_pylist([{"sample_id": f"s/{i}", "content_id": f"c{i}", "source": "s", "source_key": str(i),
                                  "image": b"x", "width": 1, "height": 1} for i in range(50)], schema=schemas.SAMPLES)
    write_partition(storage, "samples", source_predicate("s"), rows, index=no_index)
    uri = storage.lance_uri("samples")
    assert not lance_io.require_table(uri).describe_indices()
    report = index_table(uri, "samples")
    names = {d.name for d in lance_io.require_table(uri).describe_indices()}
    assert report.version == lance_io.table_version(uri) and {"sample_id_btree", "source_bitmap"} <= names
