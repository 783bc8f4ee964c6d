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
    """Progress lines through `report`, at most every `seconds` plus once at the end:
    `label: 12/40 units, 120,000/400,000 rows, 3,100 rows/s, ETA 1m30s`.

    Rates count only this call's work: units skipped on resume (`begin`) are done, not fast."""

    def __init__(self, report: Callable[[str], None], label: str, seconds: float = 5.0, unit: str = "units") -> None:
        self.report, self.label, self.seconds, self.unit = report, label, seconds, unit
        self.start = self.last = time.monotonic()
        self.base_done = self.base_rows = 0

    def begin(self, done: int, rows: int = 0) -> None:
        """Work already done before this call (resumed units): reported, not counted in rates."""
        self.start = self.last = time.monotonic()
        self.base_done, self.base_rows = done, rows
        if done:
            self.report(f"{self.label}: resuming, {done} {self.unit} already done ({rows:,} rows)")

    def __call__(self, done: int, total: int, rows: int | None = None, total_rows: int | None = None) -> None:
        now = time.monotonic()
        if done != total and now - self.last < self.seconds:
            return
        self.last = now
        elapsed = max(now - self.start, 1e-9)
        parts = [f"{done}/{total} {self.unit}"]
        if rows is not None and total_rows:
            rate = (rows - self.base_rows) / elapsed
            parts += [f"{rows:,}/{total_rows:,} rows", f"{rate:,.0f} rows/s"]
            left = (total_rows - rows) / rate if rate > 0 else None
        elif rows is not None:  # rows known only once read: rate in rows, ETA in units
            parts += [f"{rows:,} rows", f"{(rows - self.base_rows) / elapsed:,.0f} rows/s"]
            unit_rate = (done - self.base_done) / elapsed
            left = (total - done) / unit_rate if unit_rate > 0 else None
        else:
            rate = (done - self.base_done) / elapsed
            parts.append(f"{rate:.1f}/s")
            left = (total - done) / rate if rate > 0 else None
        if done != total and left is not None:
            parts.append(f"ETA {format_duration(left)}")
        self.report(f"{self.label}: " + ", ".join(parts))


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def scan_partition(
    uri: str, predicate: str, columns: list[str], storage_options: dict[str, str] | None = None
) -> tuple[int, pa.Table]:
    """The pinned version and the small `columns` plus `_rowaddr` of the rows matching `predicate`."""
    import lance

    dataset = lance.dataset(uri, storage_options=storage_options or None)
    table = dataset.to_table(columns=columns, filter=predicate, with_row_address=True)
    return dataset.version, table
