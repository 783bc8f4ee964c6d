"""`prx-corpus build`: materialize the corpus through the same Dagster definitions as the UI.

Runs go into a real Dagster instance (DAGSTER_HOME), so `dagster dev` on the same home shows
them with their metadata and checks. Order: every source's per-source chain, then the global
`duplicates`, then every source's `skip_lists`. One embedded Ray serves all runs.

A failed step is reported with its cause in one line (the error's message, never a traceback:
that stays in the run's Dagster logs). What depends on it is reported as skipped, not run into
its own misleading error: inside a run Dagster does not execute a failed step's downstream, and a
later run of a source whose chain failed (its `skip_lists`; every `skip_lists` after a failed
`duplicates`) is not started. The other sources go on.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dagster as dg

from prx_assets.common import sync_partitions
from prx_assets.settings import ALL_ASSETS, PER_SOURCE, REPO, validate_request

QUIET_LOGS = {"loggers": {"console": {"config": {"log_level": "INFO"}}}}
MAX_CAUSE_CHARS = 1000  # a failure's cause in the summary; the whole error is in the run's logs


@dataclass
class StepFailure:
    asset: str
    partition: str | None
    cause: str  # one line: the error's message

    def line(self) -> str:
        return f"{self.asset} [{self.partition or 'global'}] FAILED: {self.cause}"


@dataclass
class BuildOutcome:
    runs: int = 0
    failed_runs: list[str] = field(default_factory=list)
    failed_blocking: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    metadata: dict[tuple[str, str | None], dict[str, Any]] = field(default_factory=dict)  # (asset, partition)
    failures: list[StepFailure] = field(default_factory=list)
    skipped: dict[str | None, list[str]] = field(default_factory=dict)  # partition -> assets not run

    @property
    def ok(self) -> bool:
        return not self.failed_runs and not self.failed_blocking and not self.failures

    def failed_upstream(self, partition: str | None) -> list[str]:
        """The failed assets a run of `partition` depends on: its own chain's, and the global ones."""
        return [f.asset for f in self.failures if f.partition in (partition, None)]


def prepare_instance(home: str | None) -> dg.DagsterInstance:
    """The instance under DAGSTER_HOME (default `.prx/dagster`), created with the repo's dagster.yaml."""
    path = Path(home or os.environ.get("DAGSTER_HOME") or REPO / ".prx" / "dagster").resolve()
    path.mkdir(parents=True, exist_ok=True)
    if not (path / "dagster.yaml").exists():
        shutil.copy(REPO / "dagster.yaml", path / "dagster.yaml")
    os.environ["DAGSTER_HOME"] = str(path)
    return dg.DagsterInstance.get()


def run_build(defs: dg.Definitions, instance: dg.DagsterInstance, catalog_names: list[str],
              sources: list[str] | None, select: list[str] | None, echo: Any = print) -> BuildOutcome:
    validate_request(catalog_names, sources, select)
    chosen = [a for a in ALL_ASSETS if not select or a in select]
    names = sources or catalog_names
    assets = list(defs.assets or [])
    resources = dict(defs.resources or {})
    outcome = BuildOutcome()
    plan: list[tuple[list[str], str | None]] = [([a for a in PER_SOURCE if a in chosen], n) for n in names]
    plan += [(["duplicates"], None)] if "duplicates" in chosen else []
    plan += [(["skip_lists"], n) for n in names] if "skip_lists" in chosen else []
    for keys, partition in [(k, p) for k, p in plan if k]:
        if partition is not None and (upstream := outcome.failed_upstream(partition)):
            outcome.skipped.setdefault(partition, []).extend(keys)
            echo(f"==> {', '.join(keys)} [{partition}]: skipped (upstream {', '.join(upstream)} failed)", flush=True)
            continue
        started = time.monotonic()
        echo(f"==> {', '.join(keys)}" + (f" [{partition}]" if partition else ""), flush=True)
        result = dg.materialize(assets, selection=keys, partition_key=partition, instance=instance,
                                resources=resources, run_config=QUIET_LOGS, raise_on_error=False,
                                tags={"prx/launched_by": "prx-corpus build"})
        outcome.runs += 1
        record(outcome, result, partition)
        record_steps(outcome, result, keys, partition)
        status = "ok" if result.success else "FAILED"
        echo(f"    {status} in {time.monotonic() - started:.1f} s (run {result.run_id[:8]})", flush=True)
        if not result.success:
            outcome.failed_runs.append(f"{'+'.join(keys)}[{partition or 'global'}] run {result.run_id}")
    return outcome


def caption_lines(outcome: BuildOutcome) -> list[str]:
    """`captions [source]: N captioned, M reused, K failed (captioner)` for every captions run."""
    lines = []
    for (asset, partition), meta in sorted(outcome.metadata.items(), key=lambda kv: str(kv[0])):
        if asset == "captions":
            lines.append(f"captions [{partition}]: {meta.get('captioned', 0)} captioned, {meta.get('reused', 0)} reused, "
                         f"{meta.get('failed', 0)} failed ({meta.get('captioner', '?')})")
    return lines


def failure_lines(outcome: BuildOutcome) -> list[str]:
    """One line per failed step with its cause, then per partition what was skipped because of them."""
    lines = [f.line() for f in outcome.failures]
    for partition, assets in outcome.skipped.items():
        upstream = ", ".join(dict.fromkeys(outcome.failed_upstream(partition))) or "a step"
        lines.append(f"{', '.join(assets)} [{partition or 'global'}] skipped: upstream {upstream} failed")
    return lines


def record_steps(outcome: BuildOutcome, result: dg.ExecuteInProcessResult, keys: list[str],
                 partition: str | None) -> None:
    """The run's failed steps with their causes, and the selected assets it never executed."""
    failed = []
    for event in result.get_step_failure_events():
        failed.append(event.step_key)
        outcome.failures.append(StepFailure(event.step_key, partition, failure_cause(event)))
    done = {event.step_key for event in result.get_step_success_events()} | set(failed)
    left = [key for key in keys if key not in done]
    if left:
        outcome.skipped.setdefault(partition, []).extend(left)


def failure_cause(event: dg.DagsterEvent) -> str:
    """A step failure's message in one line: a `dg.Failure`'s description, else the innermost
    exception as `Type: message` (Dagster wraps it in "Error occurred while executing op")."""
    data = event.step_failure_data
    if data.user_failure_data is not None and data.user_failure_data.description:
        text = data.user_failure_data.description
    elif data.error is not None:
        error = data.error
        while error.cause is not None:
            error = error.cause
        text = re.sub(r"^(?:[A-Za-z_]\w*\.)+(?=\w+: )", "", error.message)  # `pkg.mod.Error: ` -> `Error: `
    else:
        text = event.message or "failed (see the run's logs)"
    flat = " ".join(text.split())
    return flat if len(flat) <= MAX_CAUSE_CHARS else flat[:MAX_CAUSE_CHARS - 3] + "..."


def record(outcome: BuildOutcome, result: dg.ExecuteInProcessResult, partition: str | None) -> None:
    for event in result.get_asset_materialization_events():
        materialization = event.materialization
        outcome.metadata[(materialization.asset_key.to_user_string(), partition)] = {
            k: v.value for k, v in materialization.metadata.items()}
    for evaluation in result.get_asset_check_evaluations():
        if evaluation.passed:
            continue
        label = f"{evaluation.check_name}[{partition or 'global'}]"
        if evaluation.severity == dg.AssetCheckSeverity.ERROR and evaluation.blocking:
            outcome.failed_blocking.append(label)
        else:
            outcome.warnings.append(label)


def sync_sources(instance: dg.DagsterInstance, catalog: Any, echo: Any = print) -> None:
    added, removed = sync_partitions(instance, catalog)
    if added or removed:
        echo(f"partitions: added {added or '-'}, removed {removed or '-'}")
