"""Index refreshes off the driver: a commit's delta index is built by a Ray task.

A refresh's memory grows with the delta it indexes (~100 B per row: 10 GB for a 100M-row source,
20-40 GB for a full `duplicates` run at 1B), so on a cluster it runs on a worker, never in the
stage's driver (the Ray head or the run pod). Without a cluster up (a test, a notebook) it runs in
the process, as it always did. The task asks for no CPU (`MAINTENANCE_CPUS`): batched appends
index while a stage's model actors hold every CPU of the cluster, and a task waiting for one
would wait for the actors, which wait for the driver, which waits for the task.
"""

from __future__ import annotations

import sys

from prx_core.compute.parallel import run_on_worker
from prx_core.store.lance_io import StorageOptions
from prx_core.store.maintenance import IndexReport, refresh_indexes, refresh_table_indexes

MAINTENANCE_CPUS = 0.0  # schedulable beside actors that hold every CPU; brief oversubscription


def on_cluster() -> bool:
    ray = sys.modules.get("ray")  # never imported just to ask
    return ray is not None and ray.is_initialized()


def index_table(uri: str, table: str, storage_options: StorageOptions = None) -> IndexReport:
    """`refresh_table_indexes` on a worker when a cluster is up (`commit_partition`'s `index`)."""
    if not on_cluster():
        return refresh_table_indexes(uri, table, storage_options)
    return run_on_worker(refresh_table_indexes, uri, table, storage_options, num_cpus=MAINTENANCE_CPUS)


def index_columns(uri: str, storage_options: StorageOptions = None, **columns: object) -> IndexReport:
    """`refresh_indexes` (indexes named by column) on a worker when a cluster is up."""
    if not on_cluster():
        return refresh_indexes(uri, storage_options=storage_options, **columns)
    return run_on_worker(_refresh_columns, uri, storage_options, columns, num_cpus=MAINTENANCE_CPUS)


def _refresh_columns(uri: str, storage_options: StorageOptions, columns: dict) -> IndexReport:
    return refresh_indexes(uri, storage_options=storage_options, **columns)
