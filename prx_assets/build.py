"""`prx-corpus build`: materialize the corpus through the same Dagster definitions as the UI.

Runs go into a real Dagster instance (DAGSTER_HOME), so `dagster dev` on the same home shows
them with their metadata and checks. Order: every source's per-source chain, then the global
`duplicates`, then every source's `skip_lists`. One embedded Ray serves all runs.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dagster as dg

from prx_assets.common import sync_partitions
from prx_assets.settings import ALL_ASSETS, PER_SOURCE, REPO, validate_request

QUIET_LOGS = {"loggers": {"console": {"config": {"log_level": "INFO"}}}}


@dataclass
class BuildOutcome:
    runs: int = 0
    failed_runs: list[str] = field(default_factory=list)
    failed_blocking: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    metadata: dict[tuple[str, str | None], dict[str, Any]] = field(default_factory=dict)  # (asset, partition)

    @property
    def ok(self) -> bool:
        return not self.failed_runs and not self.failed_blocking


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
        started = time.monotonic()
        echo(f"==> {', '.join(keys)}" + (f" [{partition}]" if partition else ""), flush=True)
        result = dg.materialize(assets, selection=keys, partition_key=partition, instance=instance,
                                resources=resources, run_config=QUIET_LOGS, raise_on_error=False,
                                tags={"prx/launched_by": "prx-corpus build"})
        outcome.runs += 1
        record(outcome, result, partition)
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
