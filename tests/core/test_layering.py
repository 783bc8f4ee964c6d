"""prx_core is what Ray workers, stage jobs and trainers import: it never imports Dagster."""

from __future__ import annotations

import os
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


def test_definitions_and_stage_jobs_load_without_torch() -> None:
    """Every run worker loads the definitions and every Ray job the stage entry points: importing
    mosaicml-streaming (torch, transformers) took them 15-25 s; only shard writers and readers need it."""
    probe = ("import sys, prx_assets.definitions, prx_core.stages.job; "
             "print(sorted(m for m in ('torch', 'streaming', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PRX_ROOT": "/nonexistent/corpus"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
