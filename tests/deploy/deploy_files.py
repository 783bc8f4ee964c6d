"""Offline readers and validators of deploy/: YAML documents, Kubernetes schemas (bundled with
kubernetes-validate), the trimmed KubeRay and Dagster-chart schemas written for these tests, and
Dockerfile instructions. Each validator returns a list of error strings, so a test can assert
both that the shipped files pass and that a broken copy fails."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import kubernetes_validate
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
HERE = Path(__file__).resolve().parent
K8S_VERSION = "1.37.0"  # the newest schema set kubernetes-validate bundles (kubernetes_validate/kubernetes-json-schema)
CPU_IMAGE = "ghcr.io/your-org/prx-corpus-cpu"
GPU_IMAGE = "ghcr.io/your-org/prx-corpus-gpu-vllm"


def load_documents(path: Path) -> list[Any]:
    """Every YAML document of a file (a syntax error raises), empty documents dropped."""
    with open(path) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def deploy_yaml_files() -> list[Path]:
    return sorted(DEPLOY.glob("*.yaml"))


def manifests() -> Iterator[tuple[Path, dict]]:
    """Every Kubernetes object in deploy/ (documents with apiVersion and kind)."""
    for path in deploy_yaml_files():
        for doc in load_documents(path):
            if isinstance(doc, dict) and "apiVersion" in doc and "kind" in doc:
                yield path, doc


def validate_core(doc: dict) -> list[str]:
    """Strict validation (unknown fields fail) against the bundled Kubernetes schema."""
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{doc.get('kind')}: {e.message} at {list(e.path)}"]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [f"{doc.get('kind')}: no schema ({e})"]
    return []


def validate_pod_template(template: dict, where: str) -> list[str]:
    """A pod template embedded in a custom resource or in Helm values, as a core v1 PodTemplate."""
    wrapper = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "embedded"}, "template": template}
    return [f"{where}: {e}" for e in validate_core(wrapper)]


def _schema_errors(schema: dict, instance: Any, where: str) -> list[str]:
    validator = jsonschema.Draft7Validator(schema)
    return [f"{where}: {e.message} at {list(e.absolute_path)}" for e in validator.iter_errors(instance)]


def kuberay_schema(kind: str) -> dict:
    schema = yaml.safe_load((HERE / "kuberay_v1_schema.yaml").read_text())
    if kind not in schema["kinds"]:
        raise KeyError(f"no KubeRay schema for kind {kind}")
    return {**schema, "$ref": f"#/kinds/{kind}"}


def ray_cluster_specs(doc: dict) -> list[tuple[str, dict]]:
    if doc["kind"] == "RayCluster":
        return [(doc["metadata"]["name"], doc["spec"])]
    if doc["kind"] == "RayJob" and "rayClusterSpec" in doc["spec"]:
        return [(doc["metadata"]["name"], doc["spec"]["rayClusterSpec"])]
    return []


def validate_kuberay(doc: dict) -> list[str]:
    """The custom resource against the trimmed v1 schema, each pod template against Kubernetes',
    and the autoscaling bounds the operator enforces (minReplicas <= replicas <= maxReplicas)."""
    errors = _schema_errors(kuberay_schema(doc["kind"]), doc, doc["kind"])
    if errors:
        return errors
    for name, spec in ray_cluster_specs(doc):
        errors += validate_pod_template(spec["headGroupSpec"]["template"], f"{name} head")
        for group in spec.get("workerGroupSpecs", []):
            where = f"{name} group {group['groupName']}"
            errors += validate_pod_template(group["template"], where)
            low, n, high = group.get("minReplicas", 0), group.get("replicas", 0), group.get("maxReplicas", 2**31 - 1)
            if not low <= n <= high:
                errors.append(f"{where}: replicas {n} outside [{low}, {high}]")
    return errors


def validate_helm_values(values: dict) -> list[str]:
    """The Dagster chart values against the keys this repo relies on (trimmed schema written for
    these tests), and the user deployments' env, volumes and resources as Kubernetes objects."""
    schema = yaml.safe_load((HERE / "dagster_chart_values_schema.yaml").read_text())
    errors = _schema_errors(schema, values, "dagster-values")
    if errors:
        return errors
    for dep in values["dagster-user-deployments"]["deployments"]:
        container = {"name": dep["name"], "image": f"{dep['image']['repository']}:{dep['image']['tag']}",
                     "env": dep.get("env", []), "volumeMounts": dep.get("volumeMounts", []),
                     "resources": dep.get("resources", {})}
        template = {"spec": {"containers": [container], "volumes": dep.get("volumes", [])}}
        errors += validate_pod_template(template, f"user deployment {dep['name']}")
    launcher = values["runLauncher"]["config"]["k8sRunLauncher"]
    run_pod = {"spec": {"containers": [{"name": "run", "resources": launcher.get("resources", {})}]}}
    errors += validate_pod_template(run_pod, "k8sRunLauncher.resources")
    return errors


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines, current = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        lines.append(current + line)
        current = ""
    out = []
    for line in lines:
        op, _, rest = line.partition(" ")
        out.append((op.upper(), rest.strip()))
    return out


def image_refs(obj: Any) -> list[str]:
    """Every container `image:` string and Helm `image: {repository, tag}` under obj."""
    found: list[str] = []
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key == "image" and isinstance(value, str):
                found.append(value)
            elif key == "image" and isinstance(value, dict) and "repository" in value:
                found.append(f"{value['repository']}:{value.get('tag', '')}")
            else:
                found += image_refs(value)
    elif isinstance(obj, list):
        for item in obj:
            found += image_refs(item)
    return found


def env_entries(obj: Any) -> list[dict]:
    """Every Kubernetes EnvVar (a dict with `name` and `value` or `valueFrom`) under obj."""
    found: list[dict] = []
    if isinstance(obj, dict):
        if "name" in obj and ("value" in obj or "valueFrom" in obj) and len(obj) <= 3:
            found.append(obj)
        for value in obj.values():
            found += env_entries(value)
    elif isinstance(obj, list):
        for item in obj:
            found += env_entries(item)
    return found


def code_env_vars() -> set[str]:
    """Environment variables the pipeline's code reads (os.environ / getenv)."""
    pattern = re.compile(r"""(?:environ(?:\.get)?[\[(]|getenv\()\s*["']([A-Z][A-Z0-9_]+)["']""")
    names: set[str] = set()
    for pkg in ("prx_core", "prx_assets", "prx_cli", "prx_resources"):
        for path in (REPO / pkg).rglob("*.py"):
            names |= set(pattern.findall(path.read_text()))
    return names
