"""deploy/dagster.yaml is a valid Dagster instance whose PostgreSQL URL names a driver that is
installed (SQLAlchemy 2.1 maps a bare postgresql:// to psycopg 3, which nothing installs), and the
Helm values use the same driver. tests/e2e/test_deployed_instance.py runs this instance for real."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from dagster._core.instance.config import dagster_instance_config
from dagster_postgres.utils import get_conn_string
from deploy_files import DEPLOY, load_documents
from sqlalchemy.engine import make_url


def instance() -> dict[str, Any]:
    return load_documents(DEPLOY / "dagster.yaml")[0]


def driver_errors(config: dict[str, Any], values: dict[str, Any]) -> list[str]:
    database = config["storage"]["postgres"]["postgres_db"]
    url = get_conn_string(**{**database, "username": "u", "password": "p", "hostname": "h", "db_name": "d"})
    errors = []
    try:
        make_url(url).get_dialect().import_dbapi()
    except ImportError as exc:
        errors.append(f"dagster.yaml: {url.split('://')[0]}:// needs a driver that is not installed ({exc})")
    if values["postgresql"].get("postgresqlScheme") != database.get("scheme"):
        errors.append("deploy/dagster-values.yaml postgresqlScheme differs from dagster.yaml's storage scheme")
    return errors


def test_instance_config_is_valid() -> None:
    """Dagster's own loader (an unknown or misplaced field raises); env vars resolve at run time."""
    config, instance_class = dagster_instance_config(str(DEPLOY), "dagster.yaml")
    assert instance_class is None and config["storage"]["postgres"]["postgres_db"]["scheme"] == "postgresql+psycopg2"
    # a run that died holding the `gpu` slot never frees it itself: run monitoring must
    values = load_documents(DEPLOY / "dagster-values.yaml")[0]["dagsterDaemon"]["runMonitoring"]
    assert config["run_monitoring"]["free_slots_after_run_end_seconds"] == values["freeSlotsAfterRunEndSeconds"] > 0


def test_postgres_driver_is_installed_and_shared_with_the_chart() -> None:
    assert driver_errors(instance(), load_documents(DEPLOY / "dagster-values.yaml")[0]) == []


@pytest.mark.parametrize("breakage", ["bare_scheme", "chart_differs"])
def test_a_missing_driver_or_disagreeing_chart_fails(breakage: str) -> None:
    config, values = copy.deepcopy(instance()), load_documents(DEPLOY / "dagster-values.yaml")[0]
    if breakage == "bare_scheme":
        del config["storage"]["postgres"]["postgres_db"]["scheme"]
    else:
        values["postgresql"]["postgresqlScheme"] = "postgresql+pg8000"
    assert driver_errors(config, values), breakage
