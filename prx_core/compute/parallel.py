"""Run work on Ray: bounded task fan-out, row reads by address, and progress lines.

Stages map pure `prx_core` functions over small task descriptions (a work unit, a shard to
verify), so image bytes move from storage to workers and never through the driver.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import sys
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
               max_retries: int = 2, max_in_flight: int | None = None, time_limit_s: float | None = None,
               began: Callable[[int], bool] | None = None, yield_failures: bool = False) -> Iterator[tuple[int, Any]]:
    """`fn(*args)` for every args tuple of `calls` as Ray tasks, yielding (call number, result) in
    completion order, at most `max_in_flight` at once (default: twice the cluster's CPUs) so the
    driver holds few results and calls are read lazily. A task is retried `max_retries` times (a
    dead worker, a transient storage error); then its error is raised as `TaskFailed`, or yielded
    as the result with `yield_failures` (the other tasks go on).

    With `time_limit_s`, a task running longer, retries included, is cancelled (its worker killed:
    a hang in C code, or a task Ray keeps retrying after out-of-memory kills) and fails with a
    `TimeoutError`. Its clock starts once a slot of the cluster's CPUs is free for it (tasks start
    in submission order) and, with `began(call number)`, once that says the call has begun on a
    worker (polled), so neither the queue nor a slow worker start counts."""
    import ray

    task = ray.remote(fn).options(num_cpus=num_cpus, max_retries=max_retries, retry_exceptions=max_retries > 0)
    cpus = ray.cluster_resources().get("CPU", 1)
    limit = max_in_flight or max(2, 2 * int(cpus))
    slots = max(1, int(cpus // max(num_cpus, 1e-9)))
    poll = None if time_limit_s is None else min(max(time_limit_s / 10, 0.5), 30.0)
    pending: dict[Any, int] = {}  # in submission order
    clock: dict[Any, float] = {}  # when each running task's time limit started counting
    polled = -math.inf  # `began` is asked at most every `poll` seconds (a storage lookup each)
    numbered = enumerate(calls)
    try:
        while True:
            for number, args in itertools.islice(numbered, max(0, limit - len(pending))):
                pending[task.remote(*args)] = number
            if not pending:
                return
            timeout = None
            if time_limit_s is not None:
                now = time.monotonic()
                running = list(itertools.islice(pending, slots))
                asking = began is not None and now - polled >= poll
                polled = now if asking else polled
                for ref in running:
                    if ref not in clock and (began is None or (asking and began(pending[ref]))):
                        clock[ref] = now
                counted = [clock[r] for r in running if r in clock]
                timeout = max(0.0, min(counted) + time_limit_s - now) if counted else None
                if len(counted) < len(running):  # some have not begun yet: look again soon
                    timeout = poll if timeout is None else min(timeout, poll)
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
            if not ready:
                now = time.monotonic()
                over = [r for r in pending if r in clock and now - clock[r] >= time_limit_s]
                if not over:
                    continue  # a poll: nothing over its limit yet
                ref = over[0]
                ray.cancel(ref, force=True)
                number, since = pending.pop(ref), clock.pop(ref)
                failure = TaskFailed(number, TimeoutError(
                    f"still running after {now - since:.0f} s, over the {time_limit_s:g} s time limit; cancelled"))
                if not yield_failures:
                    raise failure
                yield number, failure
                continue
            (ref,) = ready
            number = pending.pop(ref)
            clock.pop(ref, None)
            try:
                result = ray.get(ref)
            except Exception as exc:
                failure = TaskFailed(number, getattr(exc, "cause", None) or exc)  # RayTaskError wraps the cause
                if not yield_failures:
                    raise failure from exc
                result = failure
            yield number, result
    finally:
        for ref in pending:  # a failure raised, or the caller stopped reading
            ray.cancel(ref)


def on_cluster() -> bool:
    """Whether this process is connected to a Ray cluster (never imports Ray just to ask)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


# Maintenance (index builds and merges, compaction, a joined table's staging index) takes memory that
# grows with a table: 10-40 GB at PRX scale. Ray places a task asking for no CPU on the caller's node,
# the head, beside the GCS and every stage driver; so a maintenance task asks for a custom resource
# that CPU worker nodes offer and the head never does (deploy/raycluster.yaml, rayjob.yaml, slurm),
# and for memory, which Ray then reserves on that node.
MAINTENANCE_RESOURCE = "prx_maintenance"
MAINTENANCE_MEMORY = 2 << 30  # a reservation floor per task (bytes): Ray's memory is logical, never a cap
_warned: set[str] = set()


def maintenance_placement() -> dict[str, Any]:
    """The Ray options of a maintenance task: the worker-only resource and a memory reservation
    where a node of the cluster offers it; none on one machine or a cluster offering it nowhere
    (logged once: such a cluster runs maintenance wherever Ray places it, the head included)."""
    import ray

    if ray.cluster_resources().get(MAINTENANCE_RESOURCE):
        return {"resources": {MAINTENANCE_RESOURCE: 1}, "memory": MAINTENANCE_MEMORY}
    if sum(1 for node in ray.nodes() if node.get("Alive")) > 1 and MAINTENANCE_RESOURCE not in _warned:
        _warned.add(MAINTENANCE_RESOURCE)
        logging.getLogger(__name__).warning(
            "no node of this Ray cluster offers the %r resource: index builds and compaction may run on the "
            "head; start CPU workers with --resources '{\"%s\": 4}' (docs/deploy.md)", MAINTENANCE_RESOURCE,
            MAINTENANCE_RESOURCE)
    return {}


def run_on_worker(fn: Callable[..., Any], *args: Any, num_cpus: float = 1.0) -> Any:
    """`fn(*args)` as one Ray maintenance task (`maintenance_placement`), for work whose memory grows
    with a table (building an index), so the driver's does not."""
    import ray

    options = {"num_cpus": num_cpus, "max_retries": 2, **maintenance_placement()}
    return ray.get(ray.remote(fn).options(**options).remote(*args))


class TaskFailed(RuntimeError):
    """A task still failed after its retries; `cause` is the worker's exception."""

    def __init__(self, number: int, cause: BaseException) -> None:
        super().__init__(f"task {number}: {type(cause).__name__}: {cause}")
        self.number, self.cause = number, cause


def chunk(items: list[Any], size: int) -> list[list[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


@functools.lru_cache(maxsize=16)
def _pinned_dataset(uri: str, version: int, options: tuple[tuple[str, str], ...]) -> Any:
    """One open dataset per (table, version, options) per process: a unit takes rows 32-64 at a time,
    and each open reads the version's manifest again (a GET on S3, the whole fragment list)."""
    import lance

    return lance.dataset(uri, version=version, storage_options=dict(options) or None)


def take_rows(
    uri: str, version: int, addresses: list[int], columns: list[str], storage_options: dict[str, str] | None = None
) -> pa.Table:
    """Rows by address from a pinned version, in the order asked (workers read their own chunk)."""
    dataset = _pinned_dataset(uri, version, tuple(sorted((storage_options or {}).items())))
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
