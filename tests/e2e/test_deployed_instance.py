"""Dagster as deployed: deploy/dagster.yaml itself (PostgreSQL storage, the run queue with one run
per partition, the `gpu` pool, run monitoring, run retries), on a throwaway PostgreSQL, with
`dagster-daemon run`, a code server and the webserver as real processes (deployment.py).

The tests run in order on one deployment over two demo sources: the sensor adds the partitions;
a per-minute schedule tick launches the per-source runs; then one round of `captions` runs
(round_of_runs): two runs of one partition never overlap, no two captions steps hold the GPU at
once, and a run whose worker is SIGKILLed while holding the GPU slot is retried once run
monitoring has freed the slot. What the daemon did is read back from PostgreSQL. Five to seven
minutes on 2 busy cores, most of it run workers importing the definitions (~25 s each); each run
starts its own embedded Ray (one CPU, `ray:` in PRX_CONFIG).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import pytest
import yaml
from dagster._core.launcher import DefaultRunLauncher
from dagster._core.run_coordinator import QueuedRunCoordinator
from dagster._core.scheduler.instigation import InstigatorState, InstigatorStatus, InstigatorType, TickStatus
from dagster._core.storage.tags import (
    PARENT_RUN_ID_TAG,
    PARTITION_NAME_TAG,
    RETRY_NUMBER_TAG,
    SCHEDULE_NAME_TAG,
    WILL_RETRY_TAG,
)
from dagster_postgres import PostgresRunStorage
from deployment import DEPLOYED, LOCATION, REPOSITORY, Deployment, deployment
from postgres_server import postgres_server

from prx_assets.common import SOURCES as PARTITIONS

pytestmark = pytest.mark.slow

SOURCES = ("web_images", "crawl_wds")
REFRESH = ["raw_source", "samples", "buckets"]  # what the scheduled runs materialize (automation.refresh_assets)
SCHEDULE = "weekly_source_refresh"


@pytest.fixture(scope="module")
def deployed(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    folder = tmp_path_factory.mktemp("deployed")
    catalog = yaml.safe_load((demo_dir / "sources.yaml").read_text())
    sources = [dict(s, uri=str(demo_dir / s["uri"])) for s in catalog["sources"] if s["name"] in SOURCES]
    (folder / "sources.yaml").write_text(yaml.safe_dump({"sources": sources}))
    config = {"ray": {"ray_init_options": {"num_cpus": 1, "object_store_memory": 200 * 2**20,
                                           "include_dashboard": False, "logging_level": "warning"}},
              "automation": {"refresh_cron": "* * * * *", "refresh_assets": REFRESH}}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    prx_env = {"PRX_ROOT": str(folder / "corpus"), "PRX_SOURCES": str(folder / "sources.yaml"),
               "PRX_CONFIG": str(folder / "config.yaml")}
    with postgres_server() as pg, deployment(pg, folder, prx_env) as deployed:
        yield deployed


def test_the_instance_is_deploy_dagster_yaml_on_postgresql(deployed: Deployment) -> None:
    instance, shipped = deployed.instance, yaml.safe_load(DEPLOYED.read_text())
    assert isinstance(instance.run_storage, PostgresRunStorage)
    assert isinstance(instance.run_launcher, DefaultRunLauncher)
    assert isinstance(instance.run_coordinator, QueuedRunCoordinator)
    concurrency = instance.get_concurrency_config()
    assert concurrency.pool_config.default_pool_limit == 1
    assert concurrency.run_queue_config.max_concurrent_runs == shipped["concurrency"]["runs"]["max_concurrent_runs"]
    assert [dict(limit) for limit in concurrency.run_queue_config.tag_concurrency_limits] \
        == shipped["concurrency"]["runs"]["tag_concurrency_limits"]
    assert instance.run_monitoring_enabled and instance.run_retries_enabled
    assert instance.run_retries_max_retries == 2 and not instance.run_retries_retry_on_asset_or_op_failure
    # every daemon this instance needs (scheduler, sensors, run queue, monitoring, retries) heartbeats without errors
    required = set(instance.get_required_daemon_types())
    assert {"SCHEDULER", "SENSOR", "QUEUED_RUN_COORDINATOR", "MONITORING", "EVENT_LOG_CONSUMER"} <= required

    def healthy() -> bool:
        statuses = instance.get_daemon_statuses(list(required))
        return all(s.healthy for s in statuses.values())
    deployed.wait_for(f"healthy heartbeats of {sorted(required)}", healthy, 90)


def test_the_sensor_adds_the_catalog_sources_as_partitions(deployed: Deployment) -> None:
    deployed.wait_for("sources_sensor to add both sources as partitions",
                      lambda: sorted(deployed.instance.get_dynamic_partitions(PARTITIONS.name)) == sorted(SOURCES), 120)


def test_a_schedule_tick_launches_one_run_per_source(deployed: Deployment) -> None:
    selector = {"repositoryLocationName": LOCATION, "repositoryName": REPOSITORY, "scheduleName": SCHEDULE}
    started = deployed.graphql("mutation($s: ScheduleSelector!) { startSchedule(scheduleSelector: $s) { __typename "
                               "... on ScheduleStateResult { scheduleState { id status } } "
                               "... on PythonError { message } } }", s=selector)["startSchedule"]
    assert started["__typename"] == "ScheduleStateResult", started
    assert started["scheduleState"]["status"] == "RUNNING"
    tick = deployed.wait_for("a tick of the per-minute schedule that launched runs", lambda: next(
        (t for t in schedule_ticks(deployed) if t.status == TickStatus.SUCCESS and t.run_ids), None), 150)
    # The scheduler writes the schedule's state (RUNNING) once after the first tick (an hourly
    # checkpoint): a stop that lands before that write is overwritten, so stop after it.
    deployed.wait_for("the scheduler's checkpoint of the schedule's state", lambda: (
        schedule_state(deployed).instigator_data.last_iteration_timestamp), 60)
    stopped = deployed.graphql("mutation($id: String) { stopRunningSchedule(id: $id) { __typename "
                               "... on ScheduleStateResult { scheduleState { status } } } }",
                               id=started["scheduleState"]["id"])["stopRunningSchedule"]
    assert stopped == {"__typename": "ScheduleStateResult", "scheduleState": {"status": "STOPPED"}}, stopped
    assert schedule_state(deployed).status == InstigatorStatus.STOPPED
    runs = [deployed.run(run_id) for run_id in tick.run_ids]
    assert sorted(r.tags[PARTITION_NAME_TAG] for r in runs) == sorted(SOURCES)
    assert all(r.tags[SCHEDULE_NAME_TAG] == SCHEDULE and r.job_name == "refresh_source" for r in runs)
    assert all(r.asset_selection == {dg.AssetKey(a) for a in REFRESH} for r in runs)
    finished = deployed.wait_for_runs(tick.run_ids, 300)
    assert [r.status for r in finished] == [dg.DagsterRunStatus.SUCCESS] * len(SOURCES), deployed.logs()


@dataclass
class Round:
    """One round of `captions` runs (pool `gpu`) submitted together after the scheduled ones: two of
    web_images (`first`, `second`) and one of crawl_wds (`victim`) whose run worker is SIGKILLed
    once its step has started, i.e. while it holds the gpu slot; then the daemon's `retry` of it."""
    first: str
    second: str
    victim: str
    retry: str
    while_first_ran: tuple[dg.DagsterRunStatus, dg.DagsterRunStatus]


@pytest.fixture(scope="module")
def round_of_runs(deployed: Deployment) -> Round:
    first, second = (deployed.submit(["captions"], "web_images") for _ in range(2))
    victim = deployed.submit(["captions"], "crawl_wds")
    statuses = deployed.wait_for("the first run to start", lambda: (
        (deployed.run(first).status, deployed.run(second).status) if deployed.run(first).status
        == dg.DagsterRunStatus.STARTED else None), 150)

    def worker_pid() -> int | None:
        events = deployed.instance.all_logs(victim)
        if not any(e.is_dagster_event and e.dagster_event_type == dg.DagsterEventType.STEP_START for e in events):
            return None
        return next(int(m.group(1)) for e in events if (m := re.search(r"Started process for run \(pid: (\d+)\)",
                                                                        e.message or "")))
    pid = deployed.wait_for("the captions step of the run to kill", worker_pid, 150)
    try:
        os.kill(pid, signal.SIGSTOP)  # the worker stops where it is and starts no further process
    except ProcessLookupError:
        pytest.fail(f"run {victim}'s worker (pid {pid}) ended before it could be killed")
    for process in [pid, *descendants(pid)]:  # the whole run worker, as when its pod or node dies
        with contextlib.suppress(ProcessLookupError):  # a child that ended between the listing and its kill
            os.kill(process, signal.SIGKILL)
    retry = deployed.wait_for("the retry of the killed run", lambda: next(iter(deployed.instance.get_runs(
        dg.RunsFilter(tags={PARENT_RUN_ID_TAG: victim}))), None), 90)
    deployed.wait_for_runs([first, second, victim, retry.run_id], 300)
    return Round(first, second, victim, retry.run_id, statuses)


def test_two_runs_of_one_partition_never_run_at_once(deployed: Deployment, round_of_runs: Round) -> None:
    assert round_of_runs.while_first_ran == (dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.QUEUED)
    ids = [round_of_runs.first, round_of_runs.second]
    assert [deployed.run(r).status for r in ids] == [dg.DagsterRunStatus.SUCCESS] * 2, deployed.logs()
    earlier, later = sorted(deployed.instance.get_run_records(dg.RunsFilter(run_ids=ids)), key=lambda r: r.start_time)
    assert later.start_time >= earlier.end_time, "the partition limit let two runs of web_images overlap"


def test_a_run_whose_worker_is_killed_is_retried(deployed: Deployment, round_of_runs: Round) -> None:
    """With the DefaultRunLauncher the code server sees its run worker die and fails the run (run
    monitoring's worker health checks need a launcher that has them, e.g. K8sRunLauncher); the
    run-retries daemon then launches the retry, since this failure is not an asset failure."""
    killed, retry = deployed.run(round_of_runs.victim), deployed.run(round_of_runs.retry)
    assert killed.status == dg.DagsterRunStatus.FAILURE and killed.tags.get(WILL_RETRY_TAG) == "true"
    assert any("Run execution process for" in (e.message or "") for e in deployed.instance.all_logs(killed.run_id))
    assert retry.tags[RETRY_NUMBER_TAG] == "1" and retry.tags[PARTITION_NAME_TAG] == "crawl_wds"
    assert retry.status == dg.DagsterRunStatus.SUCCESS, deployed.logs()
    assert retry.asset_selection == {dg.AssetKey("captions")}


def test_the_gpu_pool_runs_one_captions_step_at_a_time(deployed: Deployment, round_of_runs: Round) -> None:
    """The killed run keeps its slot until run monitoring frees it, `free_slots_after_run_end_seconds`
    after the run ended (deploy/dagster.yaml); without that setting the retry would wait forever."""
    assert deployed.instance.get_concurrency_config().pool_config.default_pool_limit == 1
    assert deployed.instance.event_log_storage.get_concurrency_info("gpu").slot_count == 1
    ran = [round_of_runs.first, round_of_runs.second, round_of_runs.retry]
    windows = sorted(step_window(deployed, run_id, "captions") for run_id in ran)
    assert all(b[0] >= a[1] for a, b in zip(windows, windows[1:])), f"captions steps overlapped: {windows}"
    held_from = step_window(deployed, round_of_runs.victim, "captions")[0]
    (killed,) = deployed.instance.get_run_records(dg.RunsFilter(run_ids=[round_of_runs.victim]))
    freed_at = killed.end_time + deployed.instance.run_monitoring_settings["free_slots_after_run_end_seconds"]
    assert all(end <= held_from or start >= freed_at for start, end in windows), (held_from, freed_at, windows)
    # the retry existed long before the slot came free, and waited for it (in the queue, which holds
    # runs whose pool is full, or at its step)
    (retry,) = deployed.instance.get_run_records(dg.RunsFilter(run_ids=[round_of_runs.retry]))
    created, started = retry.create_timestamp.timestamp(), step_window(deployed, round_of_runs.retry, "captions")[0]
    assert created < freed_at <= started, (created, freed_at, started)


def test_no_two_runs_of_a_partition_ever_overlapped(deployed: Deployment) -> None:
    assert len([t for t in schedule_ticks(deployed) if t.run_ids]) == 1, "the stopped schedule launched runs again"
    records = [r for r in deployed.instance.get_run_records() if r.start_time]
    for partition in SOURCES:
        spans = sorted((r.start_time, r.end_time or time.time()) for r in records
                       if r.dagster_run.tags.get(PARTITION_NAME_TAG) == partition)
        assert len(spans) >= 2
        assert all(b[0] >= a[1] for a, b in zip(spans, spans[1:])), (partition, spans)


def schedule_state(deployed: Deployment) -> InstigatorState | None:
    return next((s for s in deployed.instance.all_instigator_state(instigator_type=InstigatorType.SCHEDULE)
                 if s.name == SCHEDULE), None)


def schedule_ticks(deployed: Deployment) -> list:
    state = schedule_state(deployed)
    return deployed.instance.get_ticks(state.instigator_origin_id, state.selector_id) if state else []


def step_window(deployed: Deployment, run_id: str, step: str) -> tuple[float, float]:
    events = [e for e in deployed.instance.all_logs(run_id) if e.is_dagster_event and e.step_key == step]
    start = min(e.timestamp for e in events if e.dagster_event_type == dg.DagsterEventType.STEP_START)
    ends = [e.timestamp for e in events if e.dagster_event_type == dg.DagsterEventType.STEP_SUCCESS]
    return start, max(ends, default=float("inf"))


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc; children first found, then theirs)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, queue = [], [pid]
    while queue:
        children = parents.get(queue.pop(), [])
        found += children
        queue += children
    return found
