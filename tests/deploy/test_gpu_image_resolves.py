"""The GPU image's package set (deploy/Dockerfile.gpu) is consistent: what its RUN step installs is
resolved here with pip's dry run against the registry, and checked the way its `pip check` checks
it, so a pin conflict fails CI instead of the image build of a cluster rollout.

The step, as the Dockerfile writes it: (1) vLLM and the cluster's Ray, resolved together; (2) the
runtime lock minus the lines its `grep -vE` drops, without dependencies (they replace what (1)
chose); (3) the project, without dependencies; then `pip check`. Here (1) is `pip install
--dry-run --report` with dependencies, (2) and (3) the same without, and the check evaluates every
requirement of every resulting distribution (markers and extras included) against the set. Needs
the package registry (as `make test` does); ~1-2 min.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version
from deploy_files import dockerfile_instructions

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"

pytestmark = pytest.mark.slow


def install_step(text: str) -> tuple[list[str], re.Pattern[str], bool]:
    """From the Dockerfile: the requirements of its resolved `pip install` (ARGs substituted), the
    lock lines its `grep -vE` drops, and whether it installs the project itself."""
    steps = dockerfile_instructions(text)
    args = dict(a.split("=", 1) for op, a in steps if op == "ARG" and "=" in a)
    [run] = [a for op, a in steps if op == "RUN" and "vllm==" in a]
    run = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], run)
    resolved = re.search(r"pip install -q ((?:\"[^\"]+\"\s*)+)", run)
    dropped = re.search(r"grep -vE '([^']+)'", run)
    assert resolved and dropped, "the GPU image's install step changed shape: update this test"
    return re.findall(r"\"([^\"]+)\"", resolved.group(1)), re.compile(dropped.group(1)), "--no-deps -e ." in run


def dry_run(requirements: list[str], tmp: Path, *, deps: bool) -> list[dict]:
    """pip's resolution of `requirements` (or, without deps, just their own distributions): the
    report's install list. The machine's local wheel folder and constraints are the image's neither."""
    report = tmp / f"report-{'deps' if deps else 'nodeps'}.json"
    listed = tmp / f"requirements-{'deps' if deps else 'nodeps'}.txt"
    listed.write_text("\n".join(requirements) + "\n")
    env = {**os.environ, "PIP_FIND_LINKS": "", "PIP_CONSTRAINT": "", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    # this machine is the image's platform (Linux x86_64, CPython 3.11): pip's own tags are the image's
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q", "--report", str(report),
               "--only-binary", ":all:", "-r", str(listed)] + ([] if deps else ["--no-deps"])
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, f"pip could not resolve the GPU image's packages:\n{done.stderr[-4000:]}"
    return json.loads(report.read_text())["install"]


def unmet(installed: dict[str, dict]) -> list[str]:
    """`pip check`: every requirement of every distribution, its extras' aside (pip check reads a
    distribution's requirements with no extra), that the set does not satisfy."""
    environment = {**default_environment(), "python_version": "3.11", "python_full_version": "3.11.7",
                   "platform_machine": "x86_64", "sys_platform": "linux", "platform_system": "Linux", "extra": ""}
    problems = []
    for name, meta in sorted(installed.items()):
        for line in meta.get("requires_dist") or []:
            requirement = Requirement(line)
            if requirement.marker and not requirement.marker.evaluate(environment):
                continue
            have = installed.get(canonicalize_name(requirement.name))
            if have is None:
                problems.append(f"{name} {meta['version']} requires {requirement}, which is not installed")
            elif not requirement.specifier.contains(Version(have["version"]), prereleases=True):
                problems.append(f"{name} {meta['version']} requires {requirement}, but {have['version']} is installed")
    return problems


def test_the_gpu_image_package_set_resolves_and_checks(tmp_path: Path) -> None:
    resolved, dropped, with_project = install_step((DEPLOY / "Dockerfile.gpu").read_text())
    lock = [line.split()[0] for line in (ROOT / "requirements-runtime.lock").read_text().splitlines()
            if line and not line.startswith(("#", " ")) and not dropped.match(line)]
    installed = {}
    for item in dry_run(resolved, tmp_path, deps=True) + dry_run(lock, tmp_path, deps=False):  # (2) replaces (1)
        meta = item["metadata"]
        installed[canonicalize_name(meta["name"])] = meta
    assert "vllm" in installed and installed["ray"]["version"] == re.search(r"ray\[\w+\]==([\d.]+)", " ".join(resolved)).group(1)
    if with_project:
        pyproject = (ROOT / "pyproject.toml").read_text()
        block = re.search(r"^dependencies = \[(.*?)^\]", pyproject, re.S | re.M).group(1)
        dependencies = re.findall(r'^\s*"([^"]+)"', block, re.M)
        installed["prx-corpus"] = {"name": "prx-corpus", "version": "0", "requires_dist": dependencies}
    problems = unmet(installed)
    assert problems == [], "the GPU image's `pip check` would fail:\n" + "\n".join(problems)
