"""Run work on Ray: bounded task fan-out, row reads by address, and progress lines.

Stages map pure `prx_core` functions over small task descriptions (a work unit, a shard to
verify), so image bytes move from storage to workers and never through the driver.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pyarrow as pa

Progress = Callable[[int, int], None]


def quiet_ray_data() -> None:
    """Ray Data logs every execution plan at INFO; the stage's own progress lines say enough."""
    import ray.data

    logging.getLogger("ray.data").setLevel(logging.WARNING)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False


def imap_tasks(fn: Callable[..., Any], calls: Iterable[tuple[Any, ...]], *, num_cpus: float = 1.0,
               max_retries: int = 2, max_in_flight: int | None = None) -> Iterator[tuple[int, Any]]:
    """`fn(*args)` for every args tuple of `calls` as Ray tasks, yielding (call number, result) in
    completion order, at most `max_in_flight` at once (default: twice the cluster's CPUs) so the
    driver holds few results and calls are read lazily. A task is retried `max_retries` times (a
    dead worker, a transient storage error); then its error is raised as `TaskFailed`."""
    import ray

    task = ray.remote(fn).options(num_cpus=num_cpus, max_retries=max_retries, retry_exceptions=max_retries > 0)
    limit = max_in_flight or max(2, 2 * int(ray.cluster_resources().get("CPU", 1)))
    pending: dict[Any, int] = {}
    numbered = enumerate(calls)
    while True:
        for number, args in itertools.islice(numbered, max(0, limit - len(pending))):
            pending[task.remote(*args)] = number
        if not pending:
            return
        (ready,), _ = ray.wait(list(pending), num_returns=1)
        number = pending.pop(ready)
        try:
            result = ray.get(ready)
        except Exception as exc:
            for ref in pending:
                ray.cancel(ref)
            raise TaskFailed(number, getattr(exc, "cause", None) or exc) from exc  # RayTaskError wraps the cause
        yield number, result


def run_on_worker(fn: Callable[..., Any], *args: Any, num_cpus: float = 1.0) -> Any:
    """`fn(*args)` as one Ray task, for work whose memory grows with a table (building an index),
    so the driver's does not."""
    import ray

    return ray.get(ray.remote(fn).options(num_cpus=num_cpus, max_retries=2).remote(*args))


class TaskFailed(RuntimeError):
    """A task still failed after its retries; `cause` is the worker's exception."""

    def __init__(self, number: int, cause: BaseException) -> None:
        super().__init__(f"task {number}: {type(cause).__name__}: {cause}")
        self.number, self.cause = number, cause


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
