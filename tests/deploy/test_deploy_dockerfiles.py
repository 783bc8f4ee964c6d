"""The Dockerfiles, read statically (no Docker engine here): the CPU image installs the project
with the script `make demo` runs and copies everything that script reads; the GPU image keeps
the cluster's Ray and Python and pins vLLM. Each rule is also run on a broken copy."""

from __future__ import annotations

import re
import tomllib

import pytest
from deploy_files import CPU_IMAGE, DEPLOY, REPO, dockerfile_instructions


def make_recipe_script(target: str) -> str:
    """The script a Makefile target runs through its `setup` prerequisite (`bash <script>`)."""
    text = (REPO / "Makefile").read_text()
    deps = re.search(rf"^{target}:([^\n]*)$", text, re.M)
    assert deps, f"no make target {target}"
    assert "setup" in deps.group(1).split(), f"make {target} does not run setup"
    recipe = re.search(r"^setup:[^\n]*\n((?:\t[^\n]*\n)+)", text, re.M)
    assert recipe
    script = re.search(r"bash\s+(\S+\.sh)", recipe.group(1))
    assert script
    return script.group(1)


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def files_setup_reads() -> set[str]:
    """Repository files scripts/setup.sh reads ($ROOT/<path>), the script itself included."""
    text = (REPO / "scripts" / "setup.sh").read_text()
    return {m for m in re.findall(r'\$ROOT/([\w./-]+)', text) if (REPO / m).is_file()} | {"scripts/setup.sh"}


def cpu_dockerfile_errors(text: str) -> list[str]:
    steps = dockerfile_instructions(text)
    errors = []
    script = make_recipe_script("demo")
    runs = [(i, args) for i, (op, args) in enumerate(steps) if op == "RUN"]
    install = [(i, args) for i, args in runs if f"bash {script}" in args]
    if not install:
        return [f"no RUN step runs `bash {script}` (the script make demo runs)"]
    at, command = install[0]
    if not re.search(r"\bPRX_SETUP_TEST=0\b", command):
        errors.append("setup.sh is not run with PRX_SETUP_TEST=0")
    if any(re.search(r"pip install[^&]*(-r \S*requirements\.lock|\s-e\s)", args) for _, args in runs):
        errors.append("a RUN installs the lock or the project itself, beside setup.sh")
    copied: set[str] = set()
    for op, args in steps[:at]:
        if op == "COPY":
            copied |= {src.rstrip("/") for src in args.split()[:-1] if not src.startswith("--")}
    needed = files_setup_reads() | set(pyproject()["tool"]["setuptools"]["packages"]["find"]["include"])
    needed = {n.rstrip("*") for n in needed}
    covered = {n for n in needed if n in copied or n.split("/")[0] in copied}
    errors += [f"{n} is not copied before setup.sh runs" for n in sorted(needed - covered)]
    base = next(args for op, args in steps if op == "FROM")
    if not re.fullmatch(r"python:3\.11[\w.-]*-bookworm", base):
        errors.append(f"base image {base} is not Python 3.11 on Debian bookworm")
    return errors


def test_cpu_image_installs_with_the_demo_script() -> None:
    assert make_recipe_script("demo") == "scripts/setup.sh"
    assert cpu_dockerfile_errors((DEPLOY / "Dockerfile.cpu").read_text()) == []


@pytest.mark.parametrize("breakage", ["pip_instead", "with_tests", "missing_copy", "other_python"])
def test_broken_cpu_dockerfile_fails(breakage: str) -> None:
    text = (DEPLOY / "Dockerfile.cpu").read_text()
    if breakage == "pip_instead":
        text = text.replace("PRX_SETUP_TEST=0 bash scripts/setup.sh", "pip install -r requirements.lock")
    elif breakage == "with_tests":
        text = text.replace("PRX_SETUP_TEST=0 bash", "bash")
    elif breakage == "missing_copy":
        text = text.replace("COPY prx_core/ prx_core/\n", "")
    elif breakage == "other_python":
        text = text.replace("python:3.11-slim-bookworm", "python:3.12-slim-bookworm")
    assert cpu_dockerfile_errors(text), breakage


def _pin(name: str) -> str:
    for dep in pyproject()["project"]["dependencies"]:
        match = re.fullmatch(rf"{re.escape(name)}(\[[\w,]+\])?==([\w.]+)", dep)
        if match:
            return match.group(2)
    raise AssertionError(f"{name} is not pinned in pyproject.toml")


def gpu_dockerfile_errors(text: str) -> list[str]:
    steps = dockerfile_instructions(text)
    args = dict(a.split("=", 1) for op, a in steps if op == "ARG" and "=" in a)
    errors = []
    if args.get("RAY_VERSION") != _pin("ray"):
        errors.append(f"RAY_VERSION {args.get('RAY_VERSION')} != the project's ray {_pin('ray')}")
    if not re.fullmatch(r"\d+\.\d+\.\d+", args.get("VLLM_VERSION", "")):
        errors.append("vLLM is not pinned to an exact version")
    if not args.get("CPU_IMAGE", "").startswith(CPU_IMAGE + ":"):
        errors.append("the project source does not come from the CPU image")
    froms = [a for op, a in steps if op == "FROM"]
    if not any(re.fullmatch(r"python:3\.11[\w.-]*-bookworm", f) for f in froms):
        errors.append("the runtime stage is not Python 3.11 on bookworm (the CPU image's)")
    for _, run in [(op, a) for op, a in steps if op == "RUN"]:
        for spec in re.findall(r"pip install ((?:[^&])*)", run):
            for word in spec.split():
                if not word.startswith(("-", "/", ".")) and "==" not in word:
                    errors.append(f"unpinned pip install of {word}")
    if not any(op == "RUN" and "pip check" in a for op, a in steps):
        errors.append("no `pip check` after mixing vLLM with the lock")
    return errors


def test_gpu_image_pins_vllm_and_the_cluster_ray() -> None:
    assert gpu_dockerfile_errors((DEPLOY / "Dockerfile.gpu").read_text()) == []


@pytest.mark.parametrize("breakage", ["ray_drift", "unpinned_vllm", "unpinned_extra", "no_check"])
def test_broken_gpu_dockerfile_fails(breakage: str) -> None:
    text = (DEPLOY / "Dockerfile.gpu").read_text()
    if breakage == "ray_drift":
        text = re.sub(r"ARG RAY_VERSION=\S+", "ARG RAY_VERSION=2.59.0", text)
    elif breakage == "unpinned_vllm":
        text = re.sub(r"ARG VLLM_VERSION=\S+", "ARG VLLM_VERSION=latest", text)
    elif breakage == "unpinned_extra":
        text = text.replace('"ray[data]==${RAY_VERSION}"', '"ray[data]==${RAY_VERSION}" flash-attn')
    elif breakage == "no_check":
        text = text.replace("/opt/vllm-venv/bin/pip check", "true")
    assert gpu_dockerfile_errors(text), breakage


def test_the_cpu_image_installs_nothing_beside_setup() -> None:
    """Everything the image needs (dagster-postgres for the instance included) comes from the
    lock through setup.sh, pinned with dagster: no second pip install that could drift."""
    assert "pip install" not in (DEPLOY / "Dockerfile.cpu").read_text()
    assert _pin("dagster-postgres") == _pin("dagster-k8s")   # dagster libraries share one version
