"""A crashed `prx-corpus build` never blocks the next one.

A build runs its materializations in its own process (`execute_in_process`), so nothing but that
process ever ends its Dagster runs. SIGKILLed (an OOM kill, a lost node, `kill -9`), it leaves its
run STARTED in the instance forever, holding the slot it claimed in the `gpu` pool and any step
it queued for one: the next build's `captions` waits for that slot with no end and no message.

Every build run therefore carries its process's identity as tags (`prx/process_*`: host, boot id,
PID namespace, pid and start time, as the partition locks record theirs, `prx_core.store.locks`),
and a build starts by reconciling the instance (`reconcile_runs`): a run STARTING, STARTED or
CANCELING whose process is provably gone (same host, boot and PID namespace; no such pid, or a
reused one) is marked failed, and the pool slots and queued steps of every finished run are
freed. A run of another host or container, or one launched by something else (the daemon's run
workers, an older build without the tags), is never judged: while a step of this build waits for
a slot, `PoolWait` names the runs holding it every 30 s, with what can be known of their process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import dagster as dg
from dagster._core.storage.dagster_run import FINISHED_STATUSES  # no public name for the set

from prx_core.store.locks import identity, process_gone

PROCESS_TAG = "prx/process_"  # + host, boot_id, pid_ns, pid, started
LIVE = [dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING]
WAIT_REPORT_SECONDS = 30.0


def process_tags() -> dict[str, str]:
    """This process's identity as run tags: what a later build checks to know the run is dead."""
    return {PROCESS_TAG + key: str(value) for key, value in identity().items()}


def run_process(run: dg.DagsterRun) -> dict[str, Any] | None:
    """The identity a run's tags recorded (pid as an int), or None for a run without them."""
    found = {key[len(PROCESS_TAG):]: value for key, value in run.tags.items() if key.startswith(PROCESS_TAG)}
    if not found.get("pid", "").isdigit():
        return None
    return {**found, "pid": int(found["pid"])}


def dead_runs(instance: dg.DagsterInstance) -> list[dg.DagsterRun]:
    """Runs not finished whose recorded process is provably gone (one tag query: runs of this host)."""
    host = identity()["host"]
    runs = instance.get_runs(filters=dg.RunsFilter(statuses=LIVE, tags={PROCESS_TAG + "host": host}))
    return [run for run in runs if (holder := run_process(run)) is not None and process_gone(holder)]


def reconcile_runs(instance: dg.DagsterInstance, echo: Callable[..., None] = print) -> list[str]:
    """Fail the dead runs, then free the pool slots and queued steps held by finished runs (the
    ones just failed included); one line for each run touched. Returns the run ids failed."""
    failed = []
    for run in dead_runs(instance):
        holder = run_process(run) or {}
        instance.report_run_failed(run, f"marked failed by a later prx-corpus build: its process (pid "
                                        f"{holder.get('pid')} on {holder.get('host')}) is gone")
        failed.append(run.run_id)
        echo(f"reconciled: run {run.run_id[:8]} ({run.job_name}{partition_label(run)}) was left STARTED by a build "
             f"whose process (pid {holder.get('pid')}) is gone: marked failed", flush=True)
    storage = instance.event_log_storage
    if not storage.supports_global_concurrency_limits:
        return failed
    holders: dict[str, list[str]] = {}
    for key in sorted(storage.get_concurrency_keys()):
        info = storage.get_concurrency_info(key)
        for run_id in {c.run_id for c in info.claimed_slots} | {p.run_id for p in info.pending_steps}:
            holders.setdefault(run_id, []).append(key)
    for run_id, keys in sorted(holders.items()):
        run = instance.get_run_by_id(run_id)
        if run is not None and run.status not in FINISHED_STATUSES:
            continue
        storage.free_concurrency_slots_for_run(run_id)
        status = run.status.value if run is not None else "deleted"
        echo(f"reconciled: freed the {', '.join(keys)} pool slots and queued steps of run {run_id[:8]} ({status})",
             flush=True)
    return failed


def partition_label(run: dg.DagsterRun) -> str:
    partition = run.tags.get("dagster/partition")
    return f" [{partition}]" if partition else ""


def describe_holder(instance: dg.DagsterInstance, run_id: str, step: str) -> str:
    """`run 1a2b3c4d (build_source [photos], step captions, STARTED, pid 123 on host h, alive)`."""
    run = instance.get_run_by_id(run_id)
    if run is None:
        return f"run {run_id[:8]} (deleted, step {step})"
    holder = run_process(run)
    if holder is None:
        who = "launched without a process record (Dagster's own run worker, or an older build): terminate it in " \
              "the UI if it is dead"
    elif holder.get("host") != identity()["host"] or holder.get("pid_ns") != identity()["pid_ns"]:
        who = f"pid {holder['pid']} on host {holder.get('host')}, another host or container: terminate it in the " \
              "UI if it is dead"
    else:
        who = f"pid {holder['pid']} on this host, {'gone' if process_gone(holder) else 'alive'}"
    return f"run {run_id[:8]} ({run.job_name}{partition_label(run)}, step {step}, {run.status.value}, {who})"


def waiting_lines(instance: dg.DagsterInstance, run_id: str) -> list[str]:
    """For each step of `run_id` queued for a pool slot: which runs hold the pool's slots."""
    storage = instance.event_log_storage
    if not storage.supports_global_concurrency_limits:
        return []
    lines = []
    for key in sorted(storage.get_concurrency_keys()):
        info = storage.get_concurrency_info(key)
        waiting = [p for p in info.pending_steps if p.run_id == run_id and p.assigned_timestamp is None]
        if not waiting:
            continue
        held = [describe_holder(instance, c.run_id, c.step_key) for c in info.claimed_slots if c.run_id != run_id]
        for step in waiting:
            since = time.time() - step.enqueued_timestamp.timestamp()
            lines.append(f"    {step.step_key}: waiting {since:.0f} s for a slot of pool '{key}' (limit {info.limit}), "
                         f"held by {'; '.join(held) or 'no run (the slot is being assigned)'}")
    return lines


class PoolWait:
    """While a run executes: every `interval` s, reconcile dead runs (a build killed meanwhile frees
    its slot at once) and print which runs hold the slots a step of this run waits for."""

    def __init__(self, instance: dg.DagsterInstance, run_id: str, echo: Callable[..., None],
                 interval: float | None = None) -> None:
        self.instance, self.run_id, self.echo = instance, run_id, echo
        self.interval = interval or WAIT_REPORT_SECONDS
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="prx-pool-wait", daemon=True)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                if waiting_lines(self.instance, self.run_id):
                    reconcile_runs(self.instance, self.echo)
                for line in waiting_lines(self.instance, self.run_id):
                    self.echo(line, flush=True)
            except Exception as exc:  # a busy SQLite, a storage hiccup: the run itself goes on
                self.echo(f"    (could not read the pool's holders: {type(exc).__name__}: {exc})", flush=True)

    def __enter__(self) -> PoolWait:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
