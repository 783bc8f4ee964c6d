"""deploy/networkpolicy.yaml against the pods it is meant for: the policies pass Kubernetes'
schema, and, evaluated with NetworkPolicy's rules over the labels the pods really carry (the pod
templates of raycluster.yaml and rayjob.yaml, the run pods dagster-k8s builds from the Helm values
and from deploy/dagster.yaml), Ray pods reach each other on every port, Dagster's run pods reach
only the head's Ray Client and job ports, the RayJob submitter and the KubeRay operator only the
job port, and nothing else reaches a Ray pod. Run on broken copies too: a label or port that
drifts in one file fails the check."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from dagster_k8s.container_context import K8sContainerContext
from dagster_k8s.job import DagsterK8sJobConfig, construct_dagster_k8s_job
from deploy_files import DEPLOY, load_documents, manifests, ray_cluster_specs, validate_core, validate_pod_template

# The KubeRay operator's pod labels: its Helm chart's deployment template, released under the name
# docs/deploy.md installs it with (`helm install kuberay-operator kuberay/kuberay-operator`).
KUBERAY_OPERATOR = {"app.kubernetes.io/name": "kuberay-operator", "app.kubernetes.io/instance": "kuberay-operator",
                    "app.kubernetes.io/component": "kuberay-operator"}
WORKER_PORT = 10_002  # the first of Ray's worker ports (--min-worker-port), and any other Ray port
AGENT_PORT = 52_365   # the dashboard agent's HTTP port


def bundle() -> dict[str, Any]:
    """The parsed files the checks read, as plain data a test can break."""
    kinds = [doc for _, doc in manifests()]
    return {"policies": [d for d in kinds if d["kind"] == "NetworkPolicy"],
            "raycluster": next(d for d in kinds if d["kind"] == "RayCluster"),
            "rayjob": next(d for d in kinds if d["kind"] == "RayJob"),
            "values": load_documents(DEPLOY / "dagster-values.yaml")[0],
            "instance": load_documents(DEPLOY / "dagster.yaml")[0]}


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """A Kubernetes LabelSelector applied to a pod's labels (an empty selector selects every pod)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        present = key in labels
        if (op == "In" and labels.get(key) not in values) or (op == "NotIn" and present and labels[key] in values) \
                or (op == "Exists" and not present) or (op == "DoesNotExist" and present):
            return False
    return True


def allowed(policies: list[dict], source: dict[str, str], target: dict[str, str], port: int) -> bool:
    """Whether TCP from `source` to `target`:`port` (pods of one namespace) is let in. A pod no
    Ingress policy selects takes everything; one that is selected takes what some rule allows."""
    selecting = [p["spec"] for p in policies if selects(p["spec"]["podSelector"], target)
                 and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    if not selecting:
        return True
    for spec in selecting:
        for rule in spec.get("ingress", []):
            peers = rule.get("from")
            by_peer = peers is None or any(
                "podSelector" in peer and "namespaceSelector" not in peer and selects(peer["podSelector"], source)
                for peer in peers)
            by_port = "ports" not in rule or any(
                p.get("protocol", "TCP") == "TCP" and p.get("port") == port for p in rule["ports"])
            if by_peer and by_port:
                return True
    return False


def run_pod_labels(launcher_labels: dict[str, str]) -> dict[str, str]:
    """The labels of a run pod as dagster-k8s's K8sRunLauncher builds its Job (same call and arguments)."""
    job = construct_dagster_k8s_job(
        DagsterK8sJobConfig(job_image="image"), args=[], job_name="dagster-run-1", component="run_worker",
        user_defined_k8s_config=K8sContainerContext(labels=launcher_labels).run_k8s_config,
        labels={"dagster/job": "__ASSET_JOB", "dagster/run-id": "1", "dagster/code-location": "prx-corpus"})
    return dict(job.spec.template.metadata.labels)


def head_ports(spec: dict) -> dict[str, int]:
    container = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def surface_errors(b: dict[str, Any]) -> list[str]:
    """Every connection the policies get wrong for the pods of these files."""
    heads, workers = {}, {}
    for doc in (b["raycluster"], b["rayjob"]):
        for name, spec in ray_cluster_specs(doc):
            heads[f"{name} head"] = (spec["headGroupSpec"]["template"].get("metadata", {}).get("labels", {}),
                                     head_ports(spec))
            for group in spec.get("workerGroupSpecs", []):
                workers[f"{name} {group['groupName']}"] = group["template"].get("metadata", {}).get("labels", {})
    ray_pods = {**{k: v[0] for k, v in heads.items()}, **workers}
    launcher = b["values"]["runLauncher"]["config"]["k8sRunLauncher"]
    run_pods = {"run pod (dagster-values.yaml)": run_pod_labels(launcher.get("labels", {})),
                "run pod (dagster.yaml)": run_pod_labels(b["instance"]["run_launcher"]["config"].get("labels", {}))}
    submitter = (b["rayjob"]["spec"].get("submitterPodTemplate") or {}).get("metadata", {}).get("labels", {})
    others = {"an unlabelled pod": {}, "a run pod without the launcher's labels": run_pod_labels({}),
              "the Dagster webserver": {"app.kubernetes.io/name": "dagster", "component": "dagster-webserver"}}
    policies, errors = b["policies"], []

    def expect(source: str, labels: dict, target: str, target_labels: dict, port: int, want: bool) -> None:
        if allowed(policies, labels, target_labels, port) != want:
            errors.append(f"{source} -> {target}:{port} {'refused' if want else 'let in'}")

    for target, labels in ray_pods.items():
        for source, source_labels in ray_pods.items():
            for port in (6379, WORKER_PORT, AGENT_PORT):
                expect(source, source_labels, target, labels, port, True)
        for source, source_labels in {**run_pods, **others, "the submitter": submitter,
                                      "the KubeRay operator": KUBERAY_OPERATOR}.items():
            if target in workers:
                expect(source, source_labels, target, labels, WORKER_PORT, False)
    for target, (labels, ports) in heads.items():
        if {"client", "dashboard", "gcs-server"} - set(ports):
            errors.append(f"{target}: no client, dashboard and gcs-server container ports ({ports})")
            continue
        for source, source_labels in run_pods.items():
            expect(source, source_labels, target, labels, ports["client"], True)
            expect(source, source_labels, target, labels, ports["dashboard"], True)
            expect(source, source_labels, target, labels, ports["gcs-server"], False)
        for source, source_labels in {"the submitter": submitter, "the KubeRay operator": KUBERAY_OPERATOR}.items():
            expect(source, source_labels, target, labels, ports["dashboard"], True)
            expect(source, source_labels, target, labels, ports["client"], False)
        for source, source_labels in others.items():
            for port in (*ports.values(), WORKER_PORT):
                expect(source, source_labels, target, labels, port, False)
    return errors


def test_policies_pass_the_kubernetes_schema() -> None:
    policies = bundle()["policies"]
    assert [p["metadata"]["name"] for p in policies] == ["prx-ray-between-ray-pods", "prx-ray-head-clients"]
    for policy in policies:
        assert validate_core(policy) == []
        assert policy["spec"]["policyTypes"] == ["Ingress"]
    broken = copy.deepcopy(policies[1])
    broken["spec"]["ingress"][0]["froms"] = broken["spec"]["ingress"][0].pop("from")  # unknown field
    assert validate_core(broken)
    broken = copy.deepcopy(policies[1])
    broken["spec"]["ingress"][0]["ports"][0]["port"] = [10001]
    assert validate_core(broken)


def test_the_submitter_template_is_a_valid_pod_template() -> None:
    template = bundle()["rayjob"]["spec"]["submitterPodTemplate"]
    assert validate_pod_template(template, "submitter") == []
    assert template["spec"]["restartPolicy"] == "Never"  # a Job's pods must not restart in place


def test_the_policies_let_in_exactly_the_ray_and_dagster_pods() -> None:
    assert surface_errors(bundle()) == []


def test_the_evaluator_refuses_what_a_policy_does_not_allow() -> None:
    policies = bundle()["policies"]
    head = {"app.kubernetes.io/name": "prx-corpus", "app.kubernetes.io/component": "ray-head"}
    assert allowed(policies, head, head, 6379)
    assert not allowed(policies, {"app.kubernetes.io/name": "prx-corpus"}, head, 6379)
    assert not allowed(policies, KUBERAY_OPERATOR, head, 10001)
    assert allowed([], {}, head, 6379)  # no policy: a pod is not isolated
    assert selects({}, {"any": "pod"}) and not selects({"matchExpressions": [
        {"key": "a", "operator": "In", "values": ["x"]}]}, {"a": "y"})


def _rename_cpu_group(b: dict) -> None:
    b["raycluster"]["spec"]["workerGroupSpecs"][0]["template"]["metadata"]["labels"][
        "app.kubernetes.io/component"] = "ray-worker"


def _drop_values_labels(b: dict) -> None:
    del b["values"]["runLauncher"]["config"]["k8sRunLauncher"]["labels"]


def _drop_instance_labels(b: dict) -> None:
    del b["instance"]["run_launcher"]["config"]["labels"]


def _move_client_port(b: dict) -> None:
    ports = b["rayjob"]["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]
    next(p for p in ports if p["name"] == "client")["containerPort"] = 10011


def _unlabel_rayjob_head(b: dict) -> None:
    del b["rayjob"]["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["metadata"]


def _unlabel_submitter(b: dict) -> None:
    del b["rayjob"]["spec"]["submitterPodTemplate"]["metadata"]


def _open_the_head(b: dict) -> None:
    b["policies"][1]["spec"]["ingress"][0]["from"] = [{"podSelector": {}}]


@pytest.mark.parametrize("breakage", [_rename_cpu_group, _drop_values_labels, _drop_instance_labels, _move_client_port,
                                      _unlabel_rayjob_head, _unlabel_submitter, _open_the_head])
def test_drifted_labels_ports_or_rules_fail(breakage) -> None:
    b = bundle()
    breakage(b)
    assert surface_errors(b), breakage.__name__
