"""Run image work as Ray Data pipelines, and cut Lance tables into tasks for them.

Every stage that touches pixels maps a pure `prx_core` function over small task descriptions
(a source fragment, or a chunk of row addresses of a pinned Lance version), so image bytes
move from storage to workers and never through the driver, except where the driver must
write them itself (MDS shards).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa

Progress = Callable[[int, int], None]


def quiet_ray_data() -> None:
    """Ray Data logs every execution plan at INFO; the stage's own progress lines say enough."""
    import ray.data

    logging.getLogger("ray.data").setLevel(logging.WARNING)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False


def map_tasks(
    tasks: list[dict[str, Any]],
    fn: Callable[[dict[str, Any]], pa.Table],
    *,
    ordered: bool = False,
    num_cpus: float = 1.0,
    progress: Progress | None = None,
) -> Iterator[pa.Table]:
    """Apply `fn` to every task on Ray, yielding each task's table as it completes.

    `ordered` keeps the tasks' order in the output (MDS streams must be deterministic).
    """
    if not tasks:
        return
    import ray.data

    quiet_ray_data()
    ray.data.DataContext.get_current().execution_options.preserve_order = ordered
    dataset = ray.data.from_items(tasks, override_num_blocks=len(tasks)).map_batches(
        _apply, fn_args=(fn,), batch_size=1, batch_format="pyarrow", num_cpus=num_cpus, zero_copy_batch=True
    )
    done = 0
    for batch in dataset.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=2):
        done += 1
        if progress is not None:
            progress(done, len(tasks))
        yield batch


def _apply(batch: pa.Table, fn: Callable[[dict[str, Any]], pa.Table]) -> pa.Table:
    (task,) = batch.to_pylist()
    return fn(task)


def chunk(items: list[Any], size: int) -> list[list[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def take_rows(
    uri: str, version: int, addresses: list[int], columns: list[str], storage_options: dict[str, str] | None = None
) -> pa.Table:
    """Rows by address from a pinned version, in the order asked (workers read their own chunk)."""
    import lance

    dataset = lance.dataset(uri, version=version, storage_options=storage_options or None)
    # `_take_rows` takes row addresses (fragment << 32 | offset) as returned by a scan with
    # `with_row_address`; the public `take` wants global offsets, which deletions shift.
    table = dataset._take_rows(addresses, columns=columns)
    if table.num_rows != len(addresses):
        raise RuntimeError(f"{uri}@{version}: asked for {len(addresses)} rows, got {table.num_rows}")
    return table


class Throttle:
    """Call `report(done, total)` at most every `seconds`, plus once at the end."""

    def __init__(self, report: Callable[[str], None], label: str, seconds: float = 5.0) -> None:
        self.report, self.label, self.seconds = report, label, seconds
        self.start = self.last = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done == total or now - self.last >= self.seconds:
            self.last = now
            rate = done / max(now - self.start, 1e-9)
            self.report(f"{self.label}: {done}/{total} ({rate:.1f}/s)")


def scan_partition(
    uri: str, predicate: str, columns: list[str], storage_options: dict[str, str] | None = None
) -> tuple[int, pa.Table]:
    """The pinned version and the small `columns` plus `_rowaddr` of the rows matching `predicate`."""
    import lance

    dataset = lance.dataset(uri, storage_options=storage_options or None)
    table = dataset.to_table(columns=columns, filter=predicate, with_row_address=True)
    return dataset.version, table
