"""Index refreshes off the driver: a commit's delta index is built by a Ray task.

A refresh's memory grows with the delta it indexes (~100 B per row: 10 GB for a 100M-row source,
20-40 GB for a full `duplicates` run at 1B), so on a cluster it runs on a worker, never in the
stage's driver (the Ray head or the run pod). Without a cluster up (a test, a notebook) it runs in
the process, as it always did. The task asks for no CPU (`MAINTENANCE_CPUS`): batched appends
index while a stage's model actors hold every CPU of the cluster, and a task waiting for one
would wait for the actors, which wait for the driver, which waits for the task.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prx_core.compute.parallel import on_cluster, run_on_worker
from prx_core.store.lance_io import StorageOptions
from prx_core.store.maintenance import IndexReport, refresh_indexes, refresh_table_indexes

MAINTENANCE_CPUS = 0.0  # schedulable beside actors that hold every CPU; brief oversubscription


def on_worker(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` as a Ray task asking for no CPU when a cluster is up, else in this process."""
    if not on_cluster():
        return fn(*args)
    return run_on_worker(fn, *args, num_cpus=MAINTENANCE_CPUS)


def index_table(uri: str, table: str, storage_options: StorageOptions = None) -> IndexReport:
    """`refresh_table_indexes` on a worker when a cluster is up (`commit_partition`'s `index`)."""
    return on_worker(refresh_table_indexes, uri, table, storage_options)


def index_columns(uri: str, storage_options: StorageOptions = None, **columns: object) -> IndexReport:
    """`refresh_indexes` (indexes named by column) on a worker when a cluster is up."""
    return on_worker(_refresh_columns, uri, storage_options, columns)


def _refresh_columns(uri: str, storage_options: StorageOptions, columns: dict) -> IndexReport:
    return refresh_indexes(uri, storage_options=storage_options, **columns)
