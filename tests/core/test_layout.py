"""The core tests mirror prx_core: a test of `prx_core/<package>/` lives in `tests/core/<package>/`,
and a test of a sub-package (`prx_core/stages/duplicates/`) in its folder
(`tests/core/stages/duplicates/`), so the tests of a module are found where the module is. A test
that drives several sub-packages of a package, or its top-level modules, sits in the package's own
folder. Only the cross-package rules (layering, import cycles, which package imports which) and
shared helpers sit at tests/core's top."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import prx_core

HERE = Path(__file__).parent
PRX_CORE = Path(prx_core.__file__).parent
# every package of prx_core, sub-packages included, as a path relative to prx_core ("stages/duplicates")
PACKAGES = {str(p.parent.relative_to(PRX_CORE)) for p in PRX_CORE.rglob("__init__.py") if p.parent != PRX_CORE}
CROSS_PACKAGE = {"test_layering.py", "test_import_cycles.py", "test_package_imports.py", "test_layout.py"}
# filed under the package whose function they drive through the command line (prx_cli), beside its tests
THROUGH_THE_CLI = {"models/test_eval_labels_cli.py"}  # prx_core.models.label_eval


def folders_under(root: Path) -> set[str]:
    """Every folder under `root` that is not private (`_x`, `.x`), relative to it."""
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_dir()
            and not any(part.startswith(("_", ".")) for part in p.relative_to(root).parts)}


def imported_modules(path: Path) -> set[str]:
    """The prx_core modules (or packages) a test imports anywhere: `from prx_core.a import b` counts
    as `prx_core.a.b`, which is a module or a name of one; the rules below need only its prefix."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("prx_core.")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("prx_core."):
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def closer_package(folder: str, modules: set[str], packages: set[str]) -> str | None:
    """The sub-package of `folder`'s package where a test importing `modules` belongs instead: the
    one every import of `folder`'s package goes into (None: they are spread, or there is none)."""
    prefix = "prx_core." + folder.replace("/", ".") + "."
    inner = {m.removeprefix(prefix).split(".")[0] for m in modules if m.startswith(prefix)}
    if len(inner) != 1:
        return None
    (name,) = inner
    below = f"{folder}/{name}"
    return below if below in packages else None


def test_every_test_folder_is_a_prx_core_package() -> None:
    folders = folders_under(HERE)
    assert folders <= PACKAGES, f"not a prx_core package: {sorted(folders - PACKAGES)}"


def test_only_cross_package_tests_sit_at_the_top() -> None:
    assert {p.name for p in HERE.glob("test_*.py")} == CROSS_PACKAGE


def test_every_package_folder_tests_something_of_its_package() -> None:
    """A module filed under the wrong package imports nothing from it (shared builders aside)."""
    strays = [str(path.relative_to(HERE)) for path in sorted(HERE.glob("*/**/test_*.py"))
              if "prx_core." + str(path.parent.relative_to(HERE)).replace("/", ".") not in path.read_text()
              and str(path.relative_to(HERE)) not in THROUGH_THE_CLI]
    assert strays == []


def test_a_test_of_one_sub_package_lives_in_its_folder() -> None:
    """`tests/core/stages/test_x.py` importing only `prx_core.stages.duplicates...` belongs in
    `tests/core/stages/duplicates/`."""
    misplaced = {}
    for path in sorted(HERE.glob("*/**/test_*.py")):
        folder = str(path.parent.relative_to(HERE))
        if (closer := closer_package(folder, imported_modules(path), PACKAGES)) is not None:
            misplaced[str(path.relative_to(HERE))] = closer
    assert misplaced == {}


def test_the_sub_package_rule_finds_a_misplaced_test(tmp_path: Path) -> None:
    test = tmp_path / "test_x.py"
    test.write_text("from prx_core.stages.duplicates.stage import DUPLICATES\n"
                    "from prx_core.stages.duplicates import groups\nfrom prx_core.store import schemas\n")
    packages = {"stages", "stages/duplicates", "stages/samples", "store"}
    assert closer_package("stages", imported_modules(test), packages) == "stages/duplicates"
    test.write_text("from prx_core.stages.duplicates.stage import DUPLICATES\nfrom prx_core.stages import entry\n")
    assert closer_package("stages", imported_modules(test), packages) is None
    test.write_text("from prx_core.stages import entry\n")  # a module of the package, not a sub-package
    assert closer_package("stages", imported_modules(test), packages) is None


def test_no_two_test_modules_share_a_name() -> None:
    """Every test folder is on the path (conftest.py) and pytest imports a test module by its name:
    two `test_stage.py` in two folders would shadow each other."""
    names = Counter(path.name for path in HERE.rglob("*.py") if path.name != "conftest.py")
    assert sorted(name for name, count in names.items() if count > 1) == []


def test_no_test_imports_from_a_conftest() -> None:
    """Helpers live in named modules (tests/assets/materializing.py, demo_corpus.py,
    tests/explorer/explorer_corpora.py, tests/core/jpegs.py): `from conftest import` resolves to
    whichever folder's conftest pytest loaded last, so it breaks as soon as two folders share a run."""
    tests = HERE.parent
    offenders = [str(p.relative_to(tests)) for p in sorted(tests.rglob("*.py")) if p != Path(__file__)
                 and ("from conftest import" in p.read_text() or "import conftest" in p.read_text())]
    assert offenders == []
