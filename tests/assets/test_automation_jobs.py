"""The definitions' automation as an operator meets it: the condition sensor that runs the eager
assets is RUNNING by default (and can ship stopped), and the Jobs page has named jobs, so runs
launched there are not all `__ASSET_JOB`. Loads the definitions only (no Ray, no run): ~2 s."""

from __future__ import annotations

import dagster as dg
import pytest

from prx_assets.automation import AutomationSettings, automation_settings, condition_sensor
from prx_assets.definitions import build_definitions
from prx_assets.settings import PER_SOURCE, Settings, SettingsError

EAGER = {"buckets", "caption_labels", "caption_embeddings", "duplicates", "skip_lists", "explorer"}


@pytest.fixture(scope="module")
def defs(tmp_path_factory: pytest.TempPathFactory) -> dg.Definitions:
    work = tmp_path_factory.mktemp("automation-jobs")
    (work / "sources.yaml").write_text("sources:\n- {name: photos, format: imagefolder, uri: photos}\n")
    return build_definitions(Settings(root=str(work / "corpus"), sources=str(work / "sources.yaml"), config={}))


def keys(job: dg.JobDefinition) -> set[str]:
    return {key.to_user_string() for key in job.asset_layer.executable_asset_keys}


def test_the_condition_sensor_runs_every_eager_asset_by_default(defs: dg.Definitions) -> None:
    sensor = defs.resolve_sensor_def("automation_condition_sensor")
    assert isinstance(sensor, dg.AutomationConditionSensorDefinition)
    assert sensor.default_status == dg.DefaultSensorStatus.RUNNING
    graph = defs.resolve_asset_graph()
    eager = {key.to_user_string() for key in graph.get_all_asset_keys() if graph.get(key).automation_condition}
    assert eager == EAGER
    targeted = {key.to_user_string() for key in sensor.asset_selection.resolve(graph)}
    assert eager <= targeted  # so Dagster adds no default_automation_condition_sensor (stopped) beside it
    assert defs.resolve_sensor_def("sources_sensor").default_status == dg.DefaultSensorStatus.RUNNING


def test_the_condition_sensor_can_ship_stopped() -> None:
    config = Settings(root="/nowhere", sources="/nowhere/sources.yaml", config={"automation": {"condition_sensor": "stopped"}})
    chosen = automation_settings(config)
    assert chosen == AutomationSettings(condition_sensor="stopped")
    assert condition_sensor(chosen.condition_sensor).default_status == dg.DefaultSensorStatus.STOPPED
    wrong = Settings(root="/nowhere", sources="/nowhere/sources.yaml", config={"automation": {"condition_sensor": "off"}})
    with pytest.raises(SettingsError, match="automation.condition_sensor: 'off' must be running or stopped"):
        automation_settings(wrong)


def test_the_condition_sensor_ticks_at_the_configured_interval(defs: dg.Definitions) -> None:
    assert defs.resolve_sensor_def("automation_condition_sensor").minimum_interval_seconds == 30  # the default
    config = Settings(root="/nowhere", sources="/nowhere/sources.yaml", config={"automation": {"condition_interval_s": 5}})
    chosen = automation_settings(config)
    assert chosen == AutomationSettings(condition_interval_s=5)
    assert condition_sensor(chosen.condition_sensor, chosen.condition_interval_s).minimum_interval_seconds == 5
    for bad in (0, 2.5, "5", True):
        wrong = Settings(root="/nowhere", sources="/nowhere/sources.yaml", config={"automation": {"condition_interval_s": bad}})
        with pytest.raises(SettingsError, match="automation.condition_interval_s: .* must be a whole number"):
            automation_settings(wrong)


def test_the_jobs_page_has_named_jobs(defs: dg.Definitions) -> None:
    build, refresh, dedup = (defs.resolve_job_def(n) for n in ("build_source", "refresh_source", "dedup_corpus"))
    assert keys(build) == keys(refresh) == set(PER_SOURCE)
    assert build.partitions_def is not None and build.partitions_def.name == "sources"
    assert keys(dedup) == {"duplicates"} and dedup.partitions_def is None  # one run, no source to pick
    assert all(job.executor_def is dg.in_process_executor for job in (build, refresh, dedup))  # one Ray per run
    assert defs.resolve_job_def("compact_corpus").description

