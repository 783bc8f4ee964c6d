"""The `automation` section of PRX_CONFIG: the schedules' cron strings and what a scheduled refresh
materializes; defaults are weekly and daily, both schedules stopped; mistakes fail at load."""

from __future__ import annotations

import datetime as dt

import dagster as dg
import pytest

from prx_assets.automation import (
    AutomationSettings,
    automation_settings,
    compact_schedule,
    refresh_schedule,
    refresh_source_job,
    weekly_source_refresh,
)
from prx_assets.common import SOURCES
from prx_assets.settings import PER_SOURCE, Settings, SettingsError


def settings(**automation: object) -> Settings:
    return Settings(root="/nowhere", sources="/nowhere/sources.yaml", config={"automation": automation})


def test_defaults_are_weekly_and_daily_and_stopped() -> None:
    assert automation_settings(settings()) == AutomationSettings("0 2 * * 0", tuple(PER_SOURCE), "0 4 * * *")
    assert weekly_source_refresh.cron_schedule == "0 2 * * 0" and compact_schedule.cron_schedule == "0 4 * * *"
    for schedule in (weekly_source_refresh, compact_schedule):
        assert schedule.default_status == dg.DefaultScheduleStatus.STOPPED


def test_refresh_cron_and_assets_configure_the_schedule() -> None:
    chosen = automation_settings(settings(refresh_cron="*/5 * * * *", refresh_assets=["samples", "raw_source"]))
    assert chosen.refresh_assets == ("raw_source", "samples")  # the graph's order
    schedule = refresh_schedule(chosen.refresh_cron, chosen.refresh_assets)
    assert schedule.name == "weekly_source_refresh" and schedule.cron_schedule == "*/5 * * * *"
    assert schedule.default_status == dg.DefaultScheduleStatus.STOPPED
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(SOURCES.name, ["alpha", "beta"])
        when = dt.datetime(2026, 12, 1, 4, 35, tzinfo=dt.timezone.utc)
        requests = schedule(dg.build_schedule_context(instance=instance, scheduled_execution_time=when))
    assert [(r.partition_key, r.run_key) for r in requests] == [("alpha", "alpha-20261201T0435"),
                                                                ("beta", "beta-20261201T0435")]
    assert all(r.asset_selection == [dg.AssetKey("raw_source"), dg.AssetKey("samples")] for r in requests)


@pytest.mark.parametrize(("automation", "message"), [
    ({"refresh_cron": "every sunday"}, "automation.refresh_cron: 'every sunday' is not a cron string"),
    ({"compact_cron": 4}, "automation.compact_cron: 4 is not a cron string"),
    ({"refresh_assets": ["samples", "duplicates"]}, "automation.refresh_assets"),
    ({"refresh_assets": []}, "automation.refresh_assets"),
    ({"cron": "0 2 * * 0"}, "automation: unknown fields ['cron']"),
])
def test_mistakes_name_the_field(automation: dict, message: str) -> None:
    with pytest.raises(SettingsError, match=message.replace("[", r"\[").replace("]", r"\]").replace("*", r"\*")):
        automation_settings(settings(**automation))


def test_refresh_runs_its_steps_in_one_process() -> None:
    """One Ray (embedded, or one connection to the cluster) per run, not one per step."""
    assert refresh_source_job.executor_def is dg.in_process_executor
