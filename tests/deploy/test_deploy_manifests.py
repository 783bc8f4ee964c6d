"""deploy/ as a platform team applies it: every YAML parses, core kinds pass the bundled
Kubernetes schema, KubeRay kinds pass the v1 schema, the Helm values have the structure the
Dagster chart reads, and deploy/dagster.yaml is a valid Dagster instance. All offline. Each
check is also run on a broken copy, to show it can fail."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from dagster._config import validate_config
from dagster._core.instance.config import dagster_instance_config_schema
from dagster_k8s import K8sRunLauncher
from deploy_files import (
    DEPLOY,
    REPO,
    deploy_yaml_files,
    load_documents,
    manifests,
    validate_core,
    validate_helm_values,
    validate_kuberay,
)

KUBERAY_KINDS = {"RayCluster", "RayJob"}


def _by_kind(kind: str) -> dict:
    return next(doc for _, doc in manifests() if doc["kind"] == kind)


def _values() -> dict:
    return load_documents(DEPLOY / "dagster-values.yaml")[0]


def test_every_deploy_yaml_parses() -> None:
    files = deploy_yaml_files()
    assert {"dagster-values.yaml", "dagster.yaml", "networkpolicy.yaml", "raycluster.yaml", "rayjob.yaml"} <= {
        p.name for p in files}
    for path in files:
        assert load_documents(path), f"{path.name} is empty"


def test_broken_yaml_fails_to_parse(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("spec:\n  headGroupSpec: {rayStartParams: {num-cpus: '0'}\n  template: x\n")
    with pytest.raises(yaml.YAMLError):
        load_documents(bad)


def test_manifests_cover_the_expected_kinds() -> None:
    kinds = sorted(doc["kind"] for _, doc in manifests())
    assert kinds == ["ConfigMap", "NetworkPolicy", "NetworkPolicy", "RayCluster", "RayJob"]


def test_core_kinds_pass_kubernetes_schema() -> None:
    core = [(p, doc) for p, doc in manifests() if doc["kind"] not in KUBERAY_KINDS]
    assert core
    for path, doc in core:
        assert validate_core(doc) == [], path.name


def test_broken_core_kind_fails() -> None:
    doc = copy.deepcopy(_by_kind("ConfigMap"))
    doc["data"]["replicas"] = 3                       # ConfigMap data values are strings
    assert validate_core(doc)
    doc = copy.deepcopy(_by_kind("ConfigMap"))
    doc["metdata"] = doc.pop("metadata")              # a misspelled field is refused (strict)
    assert validate_core(doc)


@pytest.mark.parametrize("kind", sorted(KUBERAY_KINDS))
def test_kuberay_kinds_pass_v1_schema(kind: str) -> None:
    assert validate_kuberay(_by_kind(kind)) == []


def test_raycluster_has_autoscaled_cpu_and_gpu_groups() -> None:
    spec = _by_kind("RayCluster")["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert set(groups) == {"cpu", "gpu-vllm"}
    for group in groups.values():
        assert group["maxReplicas"] > group["minReplicas"]
    gpu = groups["gpu-vllm"]["template"]["spec"]["containers"][0]["resources"]
    assert gpu["limits"]["nvidia.com/gpu"] == gpu["requests"]["nvidia.com/gpu"]
    assert "nvidia.com/gpu" not in str(groups["cpu"]["template"])


@pytest.mark.parametrize("breakage", ["int_start_param", "typo_field", "no_group_name", "replicas_above_max",
                                      "bad_pod_field", "bad_quantity"])
def test_broken_raycluster_fails(breakage: str) -> None:
    doc = copy.deepcopy(_by_kind("RayCluster"))
    spec, group = doc["spec"], doc["spec"]["workerGroupSpecs"][0]
    container = group["template"]["spec"]["containers"][0]
    if breakage == "int_start_param":
        spec["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0          # must be the string "0"
    elif breakage == "typo_field":
        spec["workerGroupSpec"] = spec.pop("workerGroupSpecs")
    elif breakage == "no_group_name":
        del group["groupName"]
    elif breakage == "replicas_above_max":
        group["replicas"] = group["maxReplicas"] + 1
    elif breakage == "bad_pod_field":
        container["imagePullPolicyy"] = "Always"
    elif breakage == "bad_quantity":
        container["resources"]["limits"]["cpu"] = ["16"]
    assert validate_kuberay(doc), breakage


def test_broken_rayjob_fails() -> None:
    doc = copy.deepcopy(_by_kind("RayJob"))
    doc["spec"]["submissionMode"] = "K8sJob"
    assert validate_kuberay(doc)
    doc = copy.deepcopy(_by_kind("RayJob"))
    doc["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["volumes"][0]["configMap"] = {"nam": "x"}
    assert validate_kuberay(doc)


def test_helm_values_have_the_chart_structure() -> None:
    assert validate_helm_values(_values()) == []


@pytest.mark.parametrize("breakage", ["misspelled_section", "run_launcher", "env_var", "tag_limit"])
def test_broken_helm_values_fail(breakage: str) -> None:
    values = _values()
    if breakage == "misspelled_section":
        values["dagsterDaemon"]["runRetry"] = values["dagsterDaemon"].pop("runRetries")
    elif breakage == "run_launcher":
        values["runLauncher"]["type"] = "DefaultRunLauncher"
    elif breakage == "env_var":
        values["dagster-user-deployments"]["deployments"][0]["env"][0]["valueFrom"] = {"secretRef": {}}
    elif breakage == "tag_limit":
        values["dagsterDaemon"]["runCoordinator"]["config"]["queuedRunCoordinator"]["tagConcurrencyLimits"][0][
            "limit"] = "one"
    assert validate_helm_values(values), breakage


def _instance_errors(instance: dict) -> list[str]:
    result = validate_config(dagster_instance_config_schema(), instance)
    errors = [e.message for e in result.errors or []]
    launcher = instance.get("run_launcher", {})
    if launcher.get("class") == "K8sRunLauncher":
        result = validate_config(K8sRunLauncher.config_type(), launcher.get("config", {}))
        errors += [e.message for e in result.errors or []]
    return errors


def test_production_dagster_yaml_is_a_valid_instance() -> None:
    instance = load_documents(DEPLOY / "dagster.yaml")[0]
    assert _instance_errors(instance) == []
    assert "postgres" in instance["storage"]
    assert instance["run_launcher"]["class"] == "K8sRunLauncher"
    assert instance["run_monitoring"]["enabled"] and instance["run_retries"]["enabled"]


def test_broken_dagster_yaml_fails() -> None:
    instance = load_documents(DEPLOY / "dagster.yaml")[0]
    instance["run_monitoring"]["start_timeout"] = 10
    assert _instance_errors(instance)
    instance = load_documents(DEPLOY / "dagster.yaml")[0]
    instance["run_launcher"]["config"]["env_secret"] = ["prx-s3-credentials"]
    assert _instance_errors(instance)


def _snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in name)


def instance_mismatches(values: dict, instance: dict) -> list[str]:
    """What the Helm values would render differently from deploy/dagster.yaml (queue, pools,
    monitoring, retries), and any drift of the per-partition limit from the repo's dagster.yaml."""
    out = []
    queue = values["dagsterDaemon"]["runCoordinator"]["config"]["queuedRunCoordinator"]
    runs = instance["concurrency"]["runs"]
    if queue["maxConcurrentRuns"] != runs["max_concurrent_runs"]:
        out.append("maxConcurrentRuns")
    if queue["tagConcurrencyLimits"] != runs["tag_concurrency_limits"]:
        out.append("tagConcurrencyLimits")
    local = load_documents(REPO / "dagster.yaml")[0]["concurrency"]
    if local["runs"]["tag_concurrency_limits"] != runs["tag_concurrency_limits"]:
        out.append("tag_concurrency_limits differ from the repo's dagster.yaml")
    if local["pools"] != instance["concurrency"]["pools"]:
        out.append("pools differ from the repo's dagster.yaml")
    pools = values["concurrency"]["pools"]
    if {_snake(k): v for k, v in pools.items()} != instance["concurrency"]["pools"]:
        out.append("pools")
    for section in ("runMonitoring", "runRetries"):
        rendered = {_snake(k): v for k, v in values["dagsterDaemon"][section].items()}
        if rendered != instance[_snake(section)]:
            out.append(section)
    return out


def test_helm_values_match_the_production_instance() -> None:
    values, instance = _values(), load_documents(DEPLOY / "dagster.yaml")[0]
    assert instance_mismatches(values, instance) == []
    limits = instance["concurrency"]["runs"]["tag_concurrency_limits"]
    assert {"key": "dagster/partition", "value": {"applyLimitPerUniqueValue": True}, "limit": 1} in limits


def test_drifted_helm_values_fail() -> None:
    values, instance = _values(), load_documents(DEPLOY / "dagster.yaml")[0]
    values["dagsterDaemon"]["runRetries"]["maxRetries"] = 5
    values["concurrency"]["pools"]["defaultLimit"] = 2
    assert instance_mismatches(values, instance) == ["pools", "runRetries"]
