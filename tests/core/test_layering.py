"""prx_core is what Ray workers, stage jobs and trainers import: it never imports Dagster."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import importlib, pkgutil, sys
import prx_core
for module in pkgutil.walk_packages(prx_core.__path__, "prx_core."):
    importlib.import_module(module.name)
print(sorted(m for m in sys.modules if m.split(".")[0] in ("dagster", "dagster_ray", "dagster_k8s", "dagster_graphql")))
"""


def test_every_prx_core_module_imports_without_dagster() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
