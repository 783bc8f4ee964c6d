"""Names that must agree across deploy/, docs/deploy.md and the code: image references, the Ray
version, environment variables, Secrets and ConfigMaps, the Ray head address, and the docs'
links. Each check is a function of the parsed files, also run on a broken copy."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
from deploy_files import (
    CPU_IMAGE,
    DEPLOY,
    GPU_IMAGE,
    REPO,
    code_env_vars,
    dockerfile_instructions,
    env_entries,
    image_refs,
    load_documents,
    manifests,
    ray_cluster_specs,
)

DOC = REPO / "docs" / "deploy.md"


def bundle() -> dict:
    """Everything the checks read, parsed once, as plain data a test can break."""
    docs = {doc["kind"]: doc for _, doc in manifests()}
    return {"values": load_documents(DEPLOY / "dagster-values.yaml")[0],
            "instance": load_documents(DEPLOY / "dagster.yaml")[0],
            "prx_config": load_documents(DEPLOY / "prx-config.gpu.yaml")[0],
            "raycluster": docs["RayCluster"], "rayjob": docs["RayJob"],
            "configmaps": {d["metadata"]["name"]: set(d["data"]) for _, d in manifests() if d["kind"] == "ConfigMap"},
            "dockerfiles": {p.name: p.read_text() for p in DEPLOY.glob("Dockerfile.*")},
            "doc": DOC.read_text(), "readme": (DEPLOY / "README.md").read_text(),
            "ray_pin": re.search(r'"ray\[[a-z,]+\]==([\d.]+)"', (REPO / "pyproject.toml").read_text()).group(1)}


def image_errors(b: dict) -> list[str]:
    built = set(re.findall(r"docker build [^\n]*?-t (\S+)", b["doc"].replace("\\\n", " ")))
    pushed = set(re.findall(r"docker push (\S+)", b["doc"]))
    errors = [] if built == pushed and len(built) == 2 else [f"docs build {built} but push {pushed}"]
    for name, text in b["dockerfiles"].items():
        header = set(re.findall(r"-t (\S+)", text.replace("\\\n", " ")))
        if header - built:
            errors.append(f"{name} header builds {header - built}, not what docs/deploy.md builds")
    gpu_args = dict(a.split("=", 1) for op, a in dockerfile_instructions(b["dockerfiles"]["Dockerfile.gpu"])
                    if op == "ARG" and "=" in a)
    expect = {"helm": (b["values"], CPU_IMAGE), "gpu base": (gpu_args["CPU_IMAGE"], CPU_IMAGE),
              "rayjob": (b["rayjob"], CPU_IMAGE)}
    spec = b["raycluster"]["spec"]
    expect["head"] = (spec["headGroupSpec"], CPU_IMAGE)
    for group in spec["workerGroupSpecs"]:
        expect[group["groupName"]] = (group, GPU_IMAGE if "gpu" in group["groupName"] else CPU_IMAGE)
    for where, (obj, repo) in expect.items():
        refs = [obj] if isinstance(obj, str) else image_refs(obj)
        for ref in refs:
            if ref not in built or not ref.startswith(repo + ":"):
                errors.append(f"{where}: image {ref} is not the {repo} image docs/deploy.md builds")
    return errors


def ray_version_errors(b: dict) -> list[str]:
    errors = []
    for doc in (b["raycluster"], b["rayjob"]):
        for name, spec in ray_cluster_specs(doc):
            if spec.get("rayVersion") != b["ray_pin"]:
                errors.append(f"{name}: rayVersion {spec.get('rayVersion')} != ray {b['ray_pin']} in pyproject.toml")
    return errors


def created(doc: str, what: str) -> dict[str, set[str]]:
    """Secrets or ConfigMaps docs/deploy.md creates: name -> keys."""
    flag = "--from-literal" if what == "secret generic" else "--from-file"
    out: dict[str, set[str]] = {}
    for name, rest in re.findall(rf"kubectl create {what} (\S+)((?: \\\n)?[^\n]*)", doc):
        out[name] = set(re.findall(rf"{flag}=([\w.-]+)=", rest))
    return out


def env_errors(b: dict) -> list[str]:
    errors = []
    secrets = created(b["doc"], "secret generic")
    configmaps = {**created(b["doc"], "configmap"), **b["configmaps"]}   # by hand, or in a manifest
    deployment = b["values"]["dagster-user-deployments"]["deployments"][0]
    head = b["rayjob"]["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    pods = {"code location": (deployment["env"], deployment["volumes"], deployment["volumeMounts"]),
            "rayjob head": (head["containers"][0]["env"], head["volumes"], head["containers"][0]["volumeMounts"])}
    read = code_env_vars()
    for where, (env, volumes, mounts) in pods.items():
        names = {e["name"]: e.get("value") for e in env}
        for required in ("PRX_ROOT", "PRX_SOURCES", "PRX_CONFIG"):
            if required not in names:
                errors.append(f"{where}: {required} is not set")
        errors += [f"{where}: {n} is set but the code never reads it" for n in names
                   if n.startswith("PRX_") and n not in read]
        for var in ("PRX_SOURCES", "PRX_CONFIG"):
            path = Path(names.get(var) or "/nowhere")
            mount = next((m for m in mounts if Path(m["mountPath"]) == path.parent), None)
            volume = next((v for v in volumes if mount and v["name"] == mount["name"]), None)
            cm = (volume or {}).get("configMap", {}).get("name")
            if cm not in configmaps or path.name not in configmaps[cm]:
                errors.append(f"{where}: {var}={path} is not a key of a ConfigMap docs/deploy.md or deploy/ creates")
    everything = [b["values"], b["raycluster"], b["rayjob"]]
    for entry in env_entries(everything):
        ref = entry.get("valueFrom", {}).get("secretKeyRef")
        if ref and (ref["name"] not in secrets or ref["key"] not in secrets[ref["name"]] or ref["key"] != entry["name"]):
            errors.append(f"env {entry['name']}: secret {ref['name']}/{ref['key']} is not created by docs/deploy.md")
        if entry["name"] not in b["doc"] + b["readme"]:
            errors.append(f"env {entry['name']} is documented neither in docs/deploy.md nor in deploy/README.md")
    launcher = b["values"]["runLauncher"]["config"]["k8sRunLauncher"]
    for name in [s["name"] for s in launcher["envSecrets"]] + b["instance"]["run_launcher"]["config"]["env_secrets"]:
        if name not in secrets:
            errors.append(f"run pods read secret {name}, which docs/deploy.md never creates")
    if "postgresql-password" not in secrets.get(b["values"]["global"]["postgresqlSecretName"], set()):
        errors.append("the chart's PostgreSQL secret (key postgresql-password) is not created by docs/deploy.md")
    pg = {v["env"] for v in b["instance"]["storage"]["postgres"]["postgres_db"].values()
          if isinstance(v, dict) and "env" in v}
    missing = pg - set(b["instance"]["run_launcher"]["config"]["env_vars"])
    errors += [f"dagster.yaml: run pods do not get {n} (run_launcher env_vars)" for n in sorted(missing)]
    return errors


def ray_address_errors(b: dict) -> list[str]:
    match = re.fullmatch(r"ray://([\w-]+):(\d+)", b["prx_config"]["ray"]["address"])
    if not match:
        return [f"ray address {b['prx_config']['ray']['address']} is not ray://<service>:<port>"]
    service, port = match.group(1), int(match.group(2))
    errors = []
    if service != b["raycluster"]["metadata"]["name"] + "-head-svc":
        errors.append(f"{service} is not the head service KubeRay creates for {b['raycluster']['metadata']['name']}")
    ports = b["raycluster"]["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]
    if port not in [p["containerPort"] for p in ports]:
        errors.append(f"the head does not expose the Ray Client port {port}")
    jobs = b["prx_config"]["ray"].get("jobs_address")
    if jobs and jobs != f"http://{service}:{next((p['containerPort'] for p in ports if p['name'] == 'dashboard'), None)}":
        errors.append(f"jobs_address {jobs} is not the job server (dashboard port) of {service}")
    return errors


def doc_errors(text: str, doc_path: Path = DOC) -> list[str]:
    errors = []
    for target in re.findall(r"\]\(([^)#\s]+)", text):
        if target.startswith(("http://", "https://")):
            continue
        if "shared/" in target or not (doc_path.parent / target).resolve().is_file():
            errors.append(f"link {target} is not a file of the repository")
    for path in sorted(DEPLOY.iterdir()):
        if path.name != "README.md" and f"deploy/{path.name}" not in text:
            errors.append(f"deploy/{path.name} is not mentioned")
    for cited in set(re.findall(r"-f (deploy/\S+)", text)):
        if not (REPO / cited).is_file():
            errors.append(f"a command uses {cited}, which does not exist")
    if not ("100M" in text and "1B" in text and "scale.md" in text):
        errors.append("no sizing for 100M and 1B images derived from docs/scale.md")
    return errors


CHECKS = {"images": image_errors, "ray version": ray_version_errors, "env": env_errors, "ray address": ray_address_errors}


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_deploy_files_agree(check: str) -> None:
    assert CHECKS[check](bundle()) == []


def _break(b: dict, breakage: str) -> None:
    spec = b["raycluster"]["spec"]
    env = b["values"]["dagster-user-deployments"]["deployments"][0]["env"]
    if breakage == "stale_tag":
        spec["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["image"] = CPU_IMAGE + ":latest"
    elif breakage == "cpu_image_on_gpu":
        spec["workerGroupSpecs"][1]["template"]["spec"]["containers"][0]["image"] = CPU_IMAGE + ":0.1.0"
    elif breakage == "ray_version":
        spec["rayVersion"] = "2.59.0"
    elif breakage == "missing_env":
        env[:] = [e for e in env if e["name"] != "PRX_SOURCES"]
    elif breakage == "unknown_env":
        env.append({"name": "PRX_CONFIG_PATH", "value": "/config/prx/prx-config.yaml"})
    elif breakage == "wrong_secret_key":
        env[-1]["valueFrom"]["secretKeyRef"]["key"] = "aws_secret_access_key"
    elif breakage == "unmounted_config":
        next(e for e in env if e["name"] == "PRX_CONFIG")["value"] = "/etc/prx/prx-config.yaml"
    elif breakage == "head_service":
        b["prx_config"]["ray"]["address"] = "ray://prx-ray-head:10001"
    elif breakage == "jobs_port":
        b["prx_config"]["ray"]["jobs_address"] = "http://prx-ray-head-svc:10001"
    elif breakage == "pg_env":
        b["instance"]["run_launcher"]["config"]["env_vars"].remove("DAGSTER_PG_PASSWORD")


@pytest.mark.parametrize("breakage,check", [
    ("stale_tag", "images"), ("cpu_image_on_gpu", "images"), ("ray_version", "ray version"),
    ("missing_env", "env"), ("unknown_env", "env"), ("wrong_secret_key", "env"), ("unmounted_config", "env"),
    ("pg_env", "env"), ("head_service", "ray address"), ("jobs_port", "ray address")])
def test_disagreeing_files_fail(breakage: str, check: str) -> None:
    b = copy.deepcopy(bundle())
    _break(b, breakage)
    assert CHECKS[check](b), breakage


def test_docs_link_only_to_repo_files_and_cover_deploy() -> None:
    assert doc_errors(DOC.read_text()) == []


@pytest.mark.parametrize("breakage", ["shared_link", "missing_file", "dropped_manifest", "no_sizing"])
def test_broken_docs_fail(breakage: str) -> None:
    text = DOC.read_text()
    if breakage == "shared_link":
        text += "\nSee [the design](../../shared/DESIGN.md).\n"
    elif breakage == "missing_file":
        text += "\nkubectl apply -f deploy/rayservice.yaml\n"
    elif breakage == "dropped_manifest":
        text = text.replace("deploy/rayjob.yaml", "the RayJob")
    elif breakage == "no_sizing":
        text = text.replace("1B", "one billion")
    assert doc_errors(text), breakage
