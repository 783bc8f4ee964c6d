"""`prx-corpus build`: materialize the corpus through the same Dagster definitions as the UI.

Runs go into a real Dagster instance (DAGSTER_HOME), so `dagster dev` on the same home shows
them with their metadata and checks. Order: every source's per-source chain (job `build_source`),
then the global `duplicates` (`dedup_corpus`), then every source's `skip_lists` and `explorer`. One embedded Ray
serves all runs.

A failed step is reported with its cause in one line (the error's message, never a traceback:
that stays in the run's Dagster logs). What depends on it is reported as skipped, not run into
its own misleading error: inside a run Dagster does not execute a failed step's downstream, and a
later run of a source whose chain failed (its `skip_lists`; every `skip_lists` after a failed
`duplicates`; `duplicates` when no source's `phashes` was written) is not started. The other
sources go on. The runs' console log keeps progress and
warnings; their failure events and tracebacks are left to the summary (`prx_cli.build_console`)
unless `verbose`.

The first Ctrl-C (SIGINT) stops the build: Dagster interrupts the step it is in (its work units
already recorded stay recorded, the units in flight abort with the embedded Ray) and no further
run starts; `outcome.interrupted` says so and `not_started` lists what was left. A SIGINT that
lands between steps, where Dagster only notes it, is seen too (`prx_core.compute.interrupts`).
A rerun resumes the interrupted attempt: each run's line says how many units it skipped.
"""

from __future__ import annotations

import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dagster as dg

from prx_cli.build_console import build_console, logger_config
from prx_cli.dead_runs import PoolWait, process_tags, reconcile_runs
from prx_assets.common import sync_partitions
from prx_assets.settings import ALL_ASSETS, PER_SOURCE, REPO, validate_request
from prx_core.compute.interrupts import SigintWatch

QUIET_LOGS = {"loggers": {"console": {"config": {"log_level": "INFO"}}}}  # Dagster's console logger
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
    interrupted: bool = False  # a SIGINT stopped the build
    interrupted_steps: list[str] = field(default_factory=list)  # `asset [partition]` a SIGINT stopped
    not_started: list[str] = field(default_factory=list)  # `assets [partition]` of the runs left after it

    @property
    def ok(self) -> bool:
        return not (self.failed_runs or self.failed_blocking or self.failures or self.interrupted)

    def failed_upstream(self, partition: str | None) -> list[str]:
        """The failed assets a run of `partition` depends on: its own chain's, and the global ones."""
        return [f.asset for f in self.failures if f.partition in (partition, None)]


def prepare_instance(home: str | None, root: str | None = None, echo: Any = print) -> dg.DagsterInstance:
    """The instance under `home`, else DAGSTER_HOME, else the root's own home (prx_cli.homes:
    `<root>/_state/dagster`), created with the repo's dagster.yaml; warns when it holds runs of another root."""
    from prx_cli.homes import default_home, warn_other_roots
    from prx_assets.settings import DEFAULT_ROOT

    root = root or os.environ.get("PRX_ROOT") or str(DEFAULT_ROOT)
    path = Path(home or os.environ.get("DAGSTER_HOME") or default_home(root)).resolve()
    path.mkdir(parents=True, exist_ok=True)
    if not (path / "dagster.yaml").exists():
        shutil.copy(REPO / "dagster.yaml", path / "dagster.yaml")
    os.environ["DAGSTER_HOME"] = str(path)
    instance = dg.DagsterInstance.get()
    warn_other_roots(instance, root, str(path), echo)
    return instance


def run_tags(defs: dg.Definitions) -> dict[str, str]:
    """Every build run's tags: who launched it, the corpus root it built (`prx/root`, prx_cli.homes),
    and its process (`prx/process_*`: how a later build knows the run died with it, prx_cli.dead_runs)."""
    from prx_cli.homes import root_tags

    storage = (defs.resources or {}).get("storage")  # stand-in definitions (tests) have none
    from prx_cli.build_report import report_tags

    return {"prx/launched_by": "prx-corpus build", **(root_tags(storage.root) if storage is not None else {}),
            **process_tags(), **report_tags()}  # and the report it writes (prx_cli.build_report)


def run_build(defs: dg.Definitions, instance: dg.DagsterInstance, catalog_names: list[str],
              sources: list[str] | None, select: list[str] | None, echo: Any = print,
              wanted: set[tuple[str, str | None]] | None = None, verbose: bool = False) -> BuildOutcome:
    validate_request(catalog_names, sources, select)
    chosen = [a for a in ALL_ASSETS if not select or a in select]
    names = sources or catalog_names
    outcome = BuildOutcome()
    reconcile_runs(instance, echo)  # a killed build's runs: failed, their pool slots freed
    plan: list[tuple[list[str], str | None]] = [([a for a in PER_SOURCE if a in chosen], n) for n in names]
    plan += [(["duplicates"], None)] if "duplicates" in chosen else []
    plan += [([a for a in ("skip_lists", "explorer") if a in chosen], n) for n in names]  # after the global duplicates
    plan = [([k for k in keys if wanted is None or (k, p) in wanted], p) for keys, p in plan]  # --stale's choice
    with SigintWatch() as sigint:
        for keys, partition in [(k, p) for k, p in plan if k]:
            label = f"{', '.join(keys)} [{partition or 'global'}]"
            if outcome.interrupted or sigint.seen():
                outcome.interrupted = True
                outcome.not_started.append(label)
                continue
            upstream = outcome.failed_upstream(partition) if partition is not None else no_phashes(outcome, plan)
            if upstream:
                outcome.skipped.setdefault(partition, []).extend(keys)
                echo(f"==> {label}: skipped (upstream {', '.join(dict.fromkeys(upstream))} failed)", flush=True)
                continue
            try:
                run_one(defs, instance, keys, partition, outcome, echo, verbose, sigint)
            except KeyboardInterrupt:  # a SIGINT outside Dagster's execution: before or after the run
                sigint.note()
                outcome.interrupted = True
    return outcome


def no_phashes(outcome: BuildOutcome, plan: list[tuple[list[str], str | None]]) -> list[str]:
    """For the global `duplicates`: the failed assets of every source whose `phashes` this build
    was to write, when none was written (it would fail "materialize `phashes` first", or regroup
    nothing new); empty when one was, or when the build writes no `phashes`."""
    planned = [p for keys, p in plan if "phashes" in keys]
    if not planned or any(("phashes", p) in outcome.metadata for p in planned):
        return []
    return [f.asset for f in outcome.failures if f.partition in planned] or ["phashes"]


def run_one(defs: dg.Definitions, instance: dg.DagsterInstance, keys: list[str], partition: str | None,
            outcome: BuildOutcome, echo: Any, verbose: bool, sigint: SigintWatch) -> None:
    """One run materializing `keys` of `partition`, its outcome recorded, its lines printed."""
    started = time.monotonic()
    echo(f"==> {', '.join(keys)}" + (f" [{partition}]" if partition else ""), flush=True)
    run_id = str(uuid.uuid4())  # known before the run starts: PoolWait watches it
    with PoolWait(instance, run_id, echo):  # says who holds a pool slot a step waits for
        result = execute(defs, instance, keys, partition, verbose, run_id)
    outcome.runs += 1
    outcome.interrupted = outcome.interrupted or sigint.seen()
    record(outcome, result, partition)
    record_steps(outcome, result, keys, partition)
    status = "ok" if result.success else "interrupted" if outcome.interrupted else "FAILED"
    echo(f"    {status} in {time.monotonic() - started:.1f} s (run {result.run_id[:8]})", flush=True)
    for line in resumed_lines(outcome, result, keys, partition):
        echo(line, flush=True)
    if not result.success and not outcome.interrupted:
        outcome.failed_runs.append(f"{'+'.join(keys)}[{partition or 'global'}] run {result.run_id}")


def execute(defs: dg.Definitions, instance: dg.DagsterInstance, keys: list[str], partition: str | None,
            verbose: bool, run_id: str | None = None) -> dg.ExecuteInProcessResult:
    """`dg.materialize` of `keys`, with the build's console logger (`build_console`) for the run."""
    name = job_name(keys)
    run_defs = dg.Definitions(jobs=[dg.define_asset_job(name, selection=keys)], assets=list(defs.assets or []),
                              resources=dict(defs.resources or {}), loggers={"console": build_console})
    return run_defs.resolve_job_def(name).execute_in_process(
        run_config=logger_config(verbose), instance=instance, partition_key=partition, raise_on_error=False,
        tags=run_tags(defs), run_id=run_id)


def job_name(keys: list[str]) -> str:
    """The run's job, as the definitions name theirs (prx_assets.automation): a source's chain is
    `build_source`, `duplicates` is `dedup_corpus`, `skip_lists` and `explorer` are `publish_source`;
    else `build_<assets>` (not `__ephemeral_asset_job__`)."""
    if set(keys) <= set(PER_SOURCE):
        return "build_source"
    if set(keys) <= {"skip_lists", "explorer"}:
        return "publish_source"
    return "dedup_corpus" if keys == ["duplicates"] else "build_" + "_".join(keys)


def resumed_lines(outcome: BuildOutcome, result: dg.ExecuteInProcessResult, keys: list[str],
                  partition: str | None) -> list[str]:
    """`    resumed samples: 3 of 5 units recorded by an earlier attempt, skipped` per asset of the run
    that resumed; from its materialization's unit counters (top level, or the `ops` entry)."""
    lines = []
    for event in result.get_asset_materialization_events():
        asset = event.materialization.asset_key.to_user_string()
        meta = outcome.metadata.get((asset, partition)) or {}
        counters = {**meta, **(meta.get("ops") if isinstance(meta.get("ops"), dict) else {})}
        resumed = {k: v for k, v in counters.items() if k.endswith("units_resumed") and isinstance(v, int) and v}
        for key, count in resumed.items():
            phase = key.removesuffix("units_resumed").rstrip("_")
            total = counters.get(key.removesuffix("_resumed"))
            of = f" of {total}" if isinstance(total, int) else ""
            lines.append(f"    resumed {asset}{f' ({phase})' if phase else ''}: {count}{of} units recorded by an "
                         "earlier attempt, skipped")
    return lines


def caption_lines(outcome: BuildOutcome) -> list[str]:
    """`captions [source]: N captioned, M reused, K failed[, R retried, J rejected by the caption checks]
    (captioner)` for every captions run."""
    lines = []
    for (asset, partition), meta in sorted(outcome.metadata.items(), key=lambda kv: str(kv[0])):
        if asset == "captions":
            checked = (f", {meta.get('retried', 0)} retried, {meta.get('rejected', 0)} rejected by the caption checks"
                       if meta.get("retried") or meta.get("rejected") else "")
            lines.append(f"captions [{partition}]: {meta.get('captioned', 0)} captioned, {meta.get('reused', 0)} reused, "
                         f"{meta.get('failed', 0)} failed{checked} ({meta.get('captioner', '?')})")
    return lines


def failure_lines(outcome: BuildOutcome) -> list[str]:
    """One line per failed step with its cause, then per partition what was skipped because of them."""
    lines = [f.line() for f in outcome.failures]
    for partition, assets in outcome.skipped.items():
        failed = outcome.failed_upstream(partition) if partition else [f.asset for f in outcome.failures]
        upstream = ", ".join(dict.fromkeys(failed)) or "a step"
        lines.append(f"{', '.join(assets)} [{partition or 'global'}] skipped: upstream {upstream} failed")
    lines += [f"{step} interrupted" for step in outcome.interrupted_steps]
    lines += [f"{label} not started: interrupted" for label in outcome.not_started]
    return lines


def record_steps(outcome: BuildOutcome, result: dg.ExecuteInProcessResult, keys: list[str],
                 partition: str | None) -> None:
    """The run's failed steps with their causes (a step a SIGINT stopped: interrupted, not failed),
    and the selected assets it never executed."""
    failed = []
    for event in result.get_step_failure_events():
        failed.append(event.step_key)
        if was_interrupted(event):
            outcome.interrupted = True
            outcome.interrupted_steps.append(f"{event.step_key} [{partition or 'global'}]")
            continue
        outcome.failures.append(StepFailure(event.step_key, partition, failure_cause(event)))
    done = {event.step_key for event in result.get_step_success_events()} | set(failed)
    left = [key for key in keys if key not in done]
    if left and outcome.interrupted:
        outcome.not_started.append(f"{', '.join(left)} [{partition or 'global'}]")
    elif left:
        outcome.skipped.setdefault(partition, []).extend(left)


def was_interrupted(event: dg.DagsterEvent) -> bool:
    """A step failure caused by a SIGINT (Dagster's DagsterExecutionInterruptedError, or a
    KeyboardInterrupt the step let through)."""
    data = event.step_failure_data
    if getattr(data.error_source, "value", None) == "INTERRUPT":  # dagster's ErrorSource.INTERRUPT
        return True
    error = data.error
    names = {"DagsterExecutionInterruptedError", "KeyboardInterrupt"}
    while error is not None:
        if error.cls_name in names:
            return True
        error = error.cause
    return False


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
        if evaluation.description:  # why it failed and what to do, as the check says it
            label += f": {' '.join(evaluation.description.split())}"
        if evaluation.severity == dg.AssetCheckSeverity.ERROR and evaluation.blocking:
            outcome.failed_blocking.append(label)
        else:
            outcome.warnings.append(label)


def sync_sources(instance: dg.DagsterInstance, catalog: Any, echo: Any = print) -> None:
    added, removed = sync_partitions(instance, catalog)
    if added or removed:
        echo(f"partitions: added {added or '-'}, removed {removed or '-'}")
