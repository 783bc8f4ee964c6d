"""The core tests mirror prx_core: a test of `prx_core/<package>/` lives in `tests/core/<package>/`,
so the tests of a module are found where the module is. Only the cross-package rules (layering,
import cycles, which package imports which) and shared helpers sit at tests/core's top."""

from __future__ import annotations

from pathlib import Path

import prx_core

HERE = Path(__file__).parent
PACKAGES = {p.name for p in Path(prx_core.__file__).parent.iterdir() if (p / "__init__.py").exists()}
CROSS_PACKAGE = {"test_layering.py", "test_import_cycles.py", "test_package_imports.py", "test_layout.py"}
# filed under the package whose function they drive through the command line (prx_cli), beside its tests
THROUGH_THE_CLI = {"models/test_eval_labels_cli.py"}  # prx_core.models.label_eval


def test_every_test_folder_is_a_prx_core_package() -> None:
    folders = {p.name for p in HERE.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))}
    assert folders <= PACKAGES, f"not a prx_core package: {sorted(folders - PACKAGES)}"


def test_only_cross_package_tests_sit_at_the_top() -> None:
    assert {p.name for p in HERE.glob("test_*.py")} == CROSS_PACKAGE


def test_every_package_folder_tests_something_of_its_package() -> None:
    """A module filed under the wrong package imports nothing from it (shared builders aside)."""
    strays = [f"{path.relative_to(HERE)}" for path in sorted(HERE.glob("*/test_*.py"))
              if f"prx_core.{path.parent.name}" not in path.read_text()
              and str(path.relative_to(HERE)) not in THROUGH_THE_CLI]
    assert strays == []


def test_no_test_imports_from_a_conftest() -> None:
    """Helpers live in named modules (tests/assets/materializing.py, demo_corpus.py,
    tests/explorer/explorer_corpora.py, tests/core/jpegs.py): `from conftest import` resolves to
    whichever folder's conftest pytest loaded last, so it breaks as soon as two folders share a run."""
    tests = HERE.parent
    offenders = [str(p.relative_to(tests)) for p in sorted(tests.rglob("*.py")) if p != Path(__file__)
                 and ("from conftest import" in p.read_text() or "import conftest" in p.read_text())]
    assert offenders == []
