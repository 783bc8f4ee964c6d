"""Materializing assets in the asset tests: settings, a fresh instance with the catalog's
partitions, one run of a selection with the definitions' resources, and what a run reported
(metadata, checks, data versions, Lance commits)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dagster as dg
from demo_corpus import Corpus

from prx_cli.build import QUIET_LOGS
from prx_assets.common import sync_partitions
from prx_assets.definitions import build_assets, build_resources
from prx_assets.settings import Settings
from prx_core.sources.catalog import Catalog
from prx_core.store import lance_io
from prx_core.store.storage import Storage


def make_settings(root: Path | str, sources: Path | str, config: dict | None = None) -> Settings:
    return Settings(root=str(root), sources=str(sources), config=config or {})


def fresh_instance(catalog: Catalog) -> dg.DagsterInstance:
    instance = dg.DagsterInstance.ephemeral()
    sync_partitions(instance, catalog)
    return instance


def materialize(resources: dict, selection: list[str], partition: str | None,
                instance: dg.DagsterInstance) -> dg.ExecuteInProcessResult:
    """One run of `selection` with the assets built from `resources` (as the definitions do)."""
    return dg.materialize(build_assets(resources), selection=selection, partition_key=partition, instance=instance,
                          resources=resources, run_config=QUIET_LOGS, raise_on_error=False)


def checks_of(result: dg.ExecuteInProcessResult) -> dict[str, dg.AssetCheckEvaluation]:
    return {e.check_name: e for e in result.get_asset_check_evaluations()}


def materialized(result: dg.ExecuteInProcessResult) -> dict[str, dict[str, Any]]:
    """asset -> metadata values of its materialization in this run."""
    return {e.materialization.asset_key.to_user_string(): {k: v.value for k, v in e.materialization.metadata.items()}
            for e in result.get_asset_materialization_events()}


def resources_for(corpus: "Corpus", root: Path, config: dict | None = None) -> dict[str, Any]:
    """The resources `build_resources` gives for another root (a copy) and/or another config."""
    return build_resources(make_settings(root, corpus.sources, config))


def check(result: dg.ExecuteInProcessResult, name: str) -> dg.AssetCheckEvaluation:
    return checks_of(result)[name]

INDEX_OPERATIONS = {"CreateIndex"}  # FTS / vector index refreshes: new versions, same rows


def commits_since(root: Path | str, table: str, version: int) -> list[tuple[int, str]]:
    """(version, Lance operation) of every commit after `version`, oldest first."""
    ds = lance_io.require_table(Storage(str(root)).lance_uri(table))
    count = ds.version - version
    transactions = ds.get_transactions(count) if count > 0 else []
    return sorted((ds.version - i, type(tx.operation).__name__) for i, tx in enumerate(transactions))


def data_version(result: dg.ExecuteInProcessResult, asset: str) -> str | None:
    (event,) = [e for e in result.get_asset_materialization_events() if e.asset_key.to_user_string() == asset]
    return event.materialization.tags.get("dagster/data_version")


def collect_checks(instance: dg.DagsterInstance) -> dict[tuple[str, str | None], Any]:
    """Every asset check evaluation of every run, by (check name, partition)."""
    out: dict[tuple[str, str | None], Any] = {}
    for run in instance.get_runs():
        partition = run.tags.get("dagster/partition")
        for entry in instance.all_logs(run.run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION):
            evaluation = entry.dagster_event.event_specific_data
            out[(evaluation.check_name, partition)] = evaluation
    return out


def transformers_config(model: Path) -> dict[str, Any]:
    return {"backend": "transformers", "model": str(model), "max_new_tokens": 8, "max_pixels": 12544, "batch_size": 8}
