"""Which top-level package may import which, read from the sources (an ast walk: lazy imports inside
functions count, which an import-time probe would miss).

prx_assets is the Dagster code location: definitions, assets, checks, automation, resources. The
command line and the build it drives are prx_cli, which imports prx_assets, never the reverse. The
benchmarks are a separate entry point (`prx-bench`): no product package imports them.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ["prx_core", "prx_resources", "prx_assets", "prx_cli", "prx_explorer"]


def imported_roots(source: str) -> set[str]:
    """The top-level names of every module `source` imports, at any depth (relative imports left out)."""
    roots = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def offenders(package: Path, forbidden: set[str]) -> list[str]:
    """`<file> imports <name>` for each forbidden top-level module a file of `package` imports."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for name in sorted(imported_roots(path.read_text()) & forbidden):
            found.append(f"{path.relative_to(package.parent)} imports {name}")
    return found


def test_the_code_location_holds_no_command_line() -> None:
    assert offenders(REPO / "prx_assets", {"argparse", "prx_cli", "benchmarks"}) == []


def test_no_product_package_imports_the_benchmarks() -> None:
    assert [line for pkg in PRODUCT for line in offenders(REPO / pkg, {"benchmarks"})] == []


def test_the_console_scripts_point_at_their_packages() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    scripts = project["project"]["scripts"]
    assert scripts["prx-corpus"].startswith("prx_cli.") and scripts["prx-bench"].startswith("benchmarks.")
    assert "prx_cli*" in project["tool"]["setuptools"]["packages"]["find"]["include"]


def test_the_walk_finds_a_lazy_import(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("def f():\n    from benchmarks.scale import run\n    import argparse.x\n")
    (tmp_path / "pkg" / "b.py").write_text("from . import benchmarks\nimport prx_core\n")
    assert offenders(tmp_path / "pkg", {"argparse", "benchmarks"}) == ["pkg/a.py imports argparse",
                                                                        "pkg/a.py imports benchmarks"]
