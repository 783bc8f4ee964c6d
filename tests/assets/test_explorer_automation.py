"""A backfill of S sources launches O(S) explorer runs: the daemon's automation, evaluated on a real
instance as its sensor would, requests no source's explorer when only the global `duplicates` moved
(it requests the cheap skip-lists, which digest each source's own groups), and one source's explorer
when that source's skip-lists got a new data version."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest
from materializing import make_settings

from prx_assets.common import SOURCES
from prx_assets.definitions import build_definitions

PER_SOURCE = ("raw_source", "samples", "buckets", "phashes", "captions", "caption_labels", "caption_embeddings",
              "text_latents", "mds_shards", "skip_lists", "explorer")
NAMES = [f"src{i}" for i in range(6)]


def materialize(instance: dg.DagsterInstance, asset: str, version: str, partition: str | None = None) -> None:
    """A materialization with a data version, as a stage's run reports it."""
    instance.report_runless_asset_event(dg.AssetMaterialization(
        asset, partition=partition, tags={"dagster/data_version": version, "dagster/code_version": "any"}))


def requested(result: dg.EvaluateAutomationConditionsResult, asset: str) -> set[str]:
    return set(result.get_requested_partitions(dg.AssetKey(asset))) if result.get_num_requested(dg.AssetKey(asset)) else set()


@pytest.fixture(scope="module")
def defs(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dg.Definitions:
    return build_definitions(make_settings(tmp_path_factory.mktemp("auto") / "root", demo_dir / "sources.yaml"))


@pytest.fixture
def backfilled(defs: dg.Definitions) -> tuple[dg.Definitions, dg.DagsterInstance, object]:
    """Every source's every asset materialized once, and the automation's first evaluation done."""
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(SOURCES.name, NAMES)
    for name in NAMES:
        for asset in PER_SOURCE:
            materialize(instance, asset, "v1", name)
    materialize(instance, "duplicates", "v1")
    first = dg.evaluate_automation_conditions(defs=defs, instance=instance)
    return defs, instance, first.cursor


def test_a_duplicates_run_requests_no_explorer(backfilled) -> None:
    defs, instance, cursor = backfilled
    materialize(instance, "duplicates", "v2")  # one more source's pHashes grouped
    result = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=cursor)
    assert requested(result, "skip_lists") == set(NAMES)  # cheap: reused unless the source's groups changed
    assert requested(result, "explorer") == set()


def test_a_sources_new_groups_request_its_explorer_only(backfilled) -> None:
    defs, instance, cursor = backfilled
    materialize(instance, "duplicates", "v2")
    cursor = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=cursor).cursor
    materialize(instance, "skip_lists", "v2", NAMES[0])  # its groups' digest changed; the others' skip-lists kept v1
    for name in NAMES[1:]:
        materialize(instance, "skip_lists", "v1", name)
    result = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=cursor)
    assert requested(result, "explorer") == {NAMES[0]}


def test_a_backfill_of_s_sources_launches_s_explorer_runs(backfilled) -> None:
    """Each source of the backfill moves `duplicates` once; only that source's explorer follows."""
    defs, instance, cursor = backfilled
    launched = 0
    for i, name in enumerate(NAMES):
        for asset in ("samples", "phashes", "skip_lists"):
            materialize(instance, asset, f"v{i + 2}", name)
        materialize(instance, "duplicates", f"v{i + 2}")
        result = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=cursor)
        cursor = result.cursor
        explorers = requested(result, "explorer")
        assert explorers <= {name}, explorers
        launched += len(explorers)
        for other in explorers:
            materialize(instance, "explorer", f"v{i + 2}", other)
    assert launched == len(NAMES)
