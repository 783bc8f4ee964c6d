"""A per-source backfill never holds a run slot while waiting for the GPU (hazard 9): judged by
Dagster's own run-queue logic (`GlobalOpConcurrencyLimitsCounter`, what the queued run
coordinator daemon asks of every queued run) on a real instance with dagster.yaml's pools; the
sensor that chains the GPU runs after the CPU ones, and the weekly refresh split the same way."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator

import dagster as dg
import pytest
import yaml

from dagster._core.events import DagsterEvent, DagsterEventType
from dagster._core.instance.config import PoolGranularity
from dagster._core.op_concurrency_limits_counter import GlobalOpConcurrencyLimitsCounter

from prx_assets.automation import refresh_schedule
from prx_assets.backfill import caption_after_ingest
from prx_assets.definitions import build_definitions
from prx_assets.settings import CPU_STAGES, GPU_CHAIN, PER_SOURCE, REPO, THEN_TAG, load_settings

SHIPPED = yaml.safe_load((REPO / "dagster.yaml").read_text())
defs = build_definitions(load_settings())  # the jobs do not depend on the root or catalog


@pytest.fixture()
def instance() -> Iterator[dg.DagsterInstance]:
    """A real instance with the shipped queue and pools (granularity op, default limit 1)."""
    overrides = {"concurrency": SHIPPED["concurrency"], "run_coordinator": SHIPPED["run_coordinator"]}
    with dg.instance_for_test(overrides=overrides) as instance:
        yield instance


def blocked(instance: dg.DagsterInstance, runs: dict[str, dg.DagsterRun]) -> dict[str, bool]:
    """Whether the run queue would keep each run queued now (what the coordinator daemon asks)."""
    storage = instance.event_log_storage
    counter = GlobalOpConcurrencyLimitsCounter(instance, list(runs.values()), [], storage.get_concurrency_keys(),
                                               storage.get_pool_limits(), pool_granularity=PoolGranularity.OP)
    return {name: counter.is_blocked(run) for name, run in runs.items()}


def test_a_gpu_run_waits_in_the_queue_not_in_a_run_slot(instance: dg.DagsterInstance) -> None:
    assert SHIPPED["concurrency"]["pools"] == {"default_limit": 1, "granularity": "op"}
    runs = {name: instance.create_run_for_job(defs.resolve_job_def(name), tags={"dagster/partition": "photos"},
                                              status=dg.DagsterRunStatus.NOT_STARTED)
            for name in ("ingest_source", "caption_source", "build_source")}
    concurrency = {name: run.run_op_concurrency for name, run in runs.items()}
    assert concurrency["ingest_source"] is None  # no pool at all
    assert concurrency["caption_source"].root_key_counts == {"gpu": 1}  # its one root step is captions
    assert not concurrency["caption_source"].has_unconstrained_root_nodes
    # the whole chain in one run: dequeued whatever the GPU's state, then it waits at captions in its slot
    assert concurrency["build_source"].has_unconstrained_root_nodes and concurrency["build_source"].all_pools == {"gpu"}

    instance.event_log_storage.initialize_concurrency_limit_to_default("gpu")
    holder = instance.event_log_storage.claim_concurrency_slot("gpu", "another-run", "captions")
    assert holder.is_claimed  # another source's captions step holds the one gpu slot
    assert blocked(instance, runs) == {"ingest_source": False, "caption_source": True, "build_source": False}
    instance.event_log_storage.free_concurrency_slots_for_run("another-run")
    assert blocked(instance, runs) == {"ingest_source": False, "caption_source": False, "build_source": False}


def test_the_jobs_split_the_chain_at_captions() -> None:
    keys = {name: {k.to_user_string() for k in defs.resolve_job_def(name).asset_layer.executable_asset_keys}
            for name in ("ingest_source", "caption_source")}
    assert keys == {"ingest_source": set(CPU_STAGES), "caption_source": set(GPU_CHAIN)}
    assert CPU_STAGES + GPU_CHAIN == PER_SOURCE
    assert defs.resolve_job_def("ingest_source").tags[THEN_TAG] == ",".join(GPU_CHAIN)


def success(instance: dg.DagsterInstance, job: str, tags: dict[str, str]) -> dg.RunStatusSensorContext:
    run = instance.create_run_for_job(defs.resolve_job_def(job), tags=tags, status=dg.DagsterRunStatus.SUCCESS)
    event = DagsterEvent(event_type_value=DagsterEventType.RUN_SUCCESS.value, job_name=job)
    return dg.build_run_status_sensor_context(sensor_name="caption_after_ingest", dagster_event=event,
                                              dagster_instance=instance, dagster_run=run)


def test_a_cpu_run_that_succeeded_queues_its_gpu_chain(instance: dg.DagsterInstance) -> None:
    context = success(instance, "ingest_source", {"dagster/partition": "photos", THEN_TAG: ",".join(GPU_CHAIN)})
    request = caption_after_ingest(context)
    assert isinstance(request, dg.RunRequest)
    assert request.partition_key == "photos" and request.run_key == f"after-{context.dagster_run.run_id}"
    assert [k.to_user_string() for k in request.asset_selection] == GPU_CHAIN
    assert caption_after_ingest.job_name == "caption_source"

    nothing = caption_after_ingest(success(instance, "refresh_source", {"dagster/partition": "photos"}))
    assert isinstance(nothing, dg.SkipReason) and "asked for nothing" in nothing.skip_message
    wrong = caption_after_ingest(success(instance, "refresh_source", {"dagster/partition": "photos", THEN_TAG: "samples"}))
    assert isinstance(wrong, dg.SkipReason) and "['samples']" in wrong.skip_message


@pytest.mark.parametrize("assets, selected, then", [
    (PER_SOURCE, CPU_STAGES, ",".join(GPU_CHAIN)),
    (["raw_source", "samples", "captions", "mds_shards"], ["raw_source", "samples"], "captions,mds_shards"),
    (["raw_source", "samples", "buckets"], ["raw_source", "samples", "buckets"], None),
    (["captions", "caption_labels"], ["captions", "caption_labels"], None),  # a GPU run from the start: queued
])
def test_the_weekly_refresh_runs_the_cpu_stages_then_the_gpu_chain(instance: dg.DagsterInstance, assets: list[str],
                                                                    selected: list[str], then: str | None) -> None:
    instance.add_dynamic_partitions("sources", ["photos"])
    schedule = refresh_schedule("0 2 * * 0", assets)
    when = dt.datetime(2026, 11, 29, 2, 0, tzinfo=dt.timezone.utc)
    (request,) = schedule(dg.build_schedule_context(instance=instance, scheduled_execution_time=when))
    assert [k.to_user_string() for k in request.asset_selection] == selected
    assert request.tags.get(THEN_TAG) == then
