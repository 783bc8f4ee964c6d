"""Every PRX_CONFIG shipped in deploy/ (the Dagster one and the RayJob's ConfigMap) is accepted by
the pipeline's own loader and builds the definitions' resources: a known section, no literal
secret, valid resource fields, and the Ray resource the manifests expect."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from deploy_files import DEPLOY, manifests

from prx_assets.settings import SettingsError, load_settings


def shipped_configs(tmp_path: Path) -> dict[str, Path]:
    out = {"prx-config.gpu.yaml": DEPLOY / "prx-config.gpu.yaml"}
    for _, doc in manifests():
        if doc["kind"] == "ConfigMap" and "prx-config.yaml" in doc["data"]:
            path = tmp_path / f"{doc['metadata']['name']}.yaml"
            path.write_text(doc["data"]["prx-config.yaml"])
            out[doc["metadata"]["name"]] = path
    return out


def _settings(path: Path):
    return load_settings({"PRX_CONFIG": str(path), "PRX_ROOT": "s3://your-bucket/prx-corpus",
                          "PRX_SOURCES": "/config/sources/sources.yaml"})


def test_shipped_configs_build_the_definitions(tmp_path: Path) -> None:
    from prx_assets.definitions import build_definitions

    configs = shipped_configs(tmp_path)
    assert set(configs) == {"prx-config.gpu.yaml", "prx-job-config"}
    addresses = {}
    for name, path in configs.items():
        ray = build_definitions(_settings(path)).resources["ray"]
        addresses[name] = (ray.address, ray.jobs_address)
    # Dagster runs connect to the long-lived cluster and submit each stage to its job server (the
    # head service's dashboard port); the RayJob driver joins the cluster it runs on
    assert addresses == {"prx-config.gpu.yaml": ("ray://prx-ray-head-svc:10001", "http://prx-ray-head-svc:8265"),
                         "prx-job-config": ("auto", None)}


@pytest.mark.parametrize("breakage", ["secret", "unknown_section"])
def test_broken_config_is_refused(tmp_path: Path, breakage: str) -> None:
    config = yaml.safe_load((DEPLOY / "prx-config.gpu.yaml").read_text())
    if breakage == "secret":
        config["storage"]["storage_options"]["secret"] = "AKIA-not-a-real-secret"
    else:
        config["rays"] = config.pop("ray")
    path = tmp_path / "prx-config.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(SettingsError):
        _settings(path)
