"""prx_core is what Ray workers, stage jobs and trainers import: it never imports Dagster."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import prx_core

PRX_CORE = Path(prx_core.__file__).parent
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


# The floors of prx_core, lowest first: a package imports only packages on floors below its own.
# The store is the ground (Lance, paths, locks, the name rule); compute runs work on Ray; upkeep
# (compaction, batched appends) and models use compute; sources and shards read and write data;
# stages put them together; the demo writes sources for the stages; ops (the doctor, the build summary, whole-corpus
# compaction) reads and maintains all of them.
FLOORS = {"image": 0, "store": 0, "compute": 1, "upkeep": 2, "models": 2, "sources": 3, "shards": 3, "stages": 4,
          "demo": 5, "ops": 5}
IMPORT = re.compile(r"^\s*(?:from|import)\s+prx_core\.([a-z_]+)", re.MULTILINE)


def floor_violations(root: Path) -> list[str]:
    """`module imports prx_core.<package>` for each import of a package not on a floor below."""
    found = []
    for path in sorted(root.rglob("*.py")):
        package = path.relative_to(root).parts[0]
        if package not in FLOORS:
            continue
        for imported in IMPORT.findall(path.read_text()):
            if imported != package and FLOORS.get(imported, 99) >= FLOORS[package]:
                found.append(f"{path.relative_to(root.parent)} imports prx_core.{imported}")
    return found


def test_every_package_of_prx_core_has_a_floor() -> None:
    packages = {p.name for p in PRX_CORE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == set(FLOORS)


def test_prx_core_imports_only_downwards() -> None:
    assert floor_violations(PRX_CORE) == []


def test_the_floor_rule_finds_an_upward_import(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "bad.py").write_text("from prx_core.compute.parallel import imap_tasks\n")
    (tmp_path / "compute").mkdir()
    (tmp_path / "compute" / "fine.py").write_text("    from prx_core.store import lance_io\n")
    # a sub-package is on its package's floor: it may import its own package, not one above
    (tmp_path / "shards" / "mds").mkdir(parents=True)
    (tmp_path / "shards" / "mds" / "fine.py").write_text("from prx_core.shards.framed import write_framed\n")
    (tmp_path / "shards" / "mds" / "bad.py").write_text("from prx_core.stages.duplicates.stage import DUPLICATES\n")
    assert floor_violations(tmp_path) == [f"{tmp_path.name}/shards/mds/bad.py imports prx_core.stages",
                                          f"{tmp_path.name}/store/bad.py imports prx_core.compute"]
