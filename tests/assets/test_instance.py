"""dagster.yaml gives a local instance with queued runs and a `gpu` pool limited to 1;
workspace.yaml loads prx_assets.definitions."""

from __future__ import annotations

import shutil
from pathlib import Path

import dagster as dg
import pytest
import yaml
from dagster._core.run_coordinator import QueuedRunCoordinator

REPO = Path(__file__).resolve().parents[2]


def test_instance_from_dagster_yaml(tmp_path: Path) -> None:
    shutil.copy(REPO / "dagster.yaml", tmp_path / "dagster.yaml")
    with dg.DagsterInstance.from_config(str(tmp_path)) as instance:
        assert isinstance(instance.run_coordinator, QueuedRunCoordinator)
        assert instance.get_concurrency_config().pool_config.default_pool_limit == 1
        assert str(tmp_path) in instance.root_directory
        assert not instance.telemetry_enabled


def test_workspace_loads_definitions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Loaded (not imported) from the environment; without PRX_ROOT / PRX_SOURCES an error naming
    them, never the demo's root by default."""
    from prx_assets.settings import SettingsError

    workspace = yaml.safe_load((REPO / "workspace.yaml").read_text())
    module = workspace["load_from"][0]["python_module"]["module_name"]
    loader = __import__(module, fromlist=["defs"]).defs
    for name in ("PRX_ROOT", "PRX_SOURCES", "PRX_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PRX_SOURCES", str(tmp_path / "sources.yaml"))
    with pytest.raises(SettingsError, match=r"^PRX_ROOT is not set: "):
        loader()
    monkeypatch.setenv("PRX_ROOT", str(tmp_path / "corpus"))
    defs = loader()
    assert isinstance(defs, dg.Definitions) and defs.resources["storage"].root == str(tmp_path / "corpus")
