"""No module of prx_core imports itself back through others: the floors between packages
(test_layering) say nothing about circles inside one package, and a circle there is what made
`stages/unchanged.py` depend on every stage and a shard helper call up into the publisher.

Every import counts, at module granularity: module level, inside functions (lazy) and under
`TYPE_CHECKING`. A lazy import only hides a circle from Python's import order, not from the reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

import prx_core

PRX_CORE = Path(prx_core.__file__).parent


def module_names(root: Path) -> dict[str, Path]:
    """`prx_core.x.y` -> its source file, for every module and package under `root`."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def resolve_base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` names, relative levels resolved against `module`."""
    if node.level == 0:
        return node.module or ""
    anchor = module.split(".") if is_package else module.split(".")[:-1]
    anchor = anchor[: len(anchor) - (node.level - 1)]
    return ".".join(anchor + ([node.module] if node.module else []))


def nearest_module(name: str, known: dict[str, Path]) -> str | None:
    """`name` if it is a module of prx_core, else its longest prefix that is (a name inside one)."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in known:
            return ".".join(parts)
        parts.pop()
    return None


def imports_of(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every module of prx_core that `module` imports anywhere in its source."""
    found: set[str] = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = resolve_base(module, is_package, node)
            # `from pkg import module` imports the module; `from module import name` the module itself
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        for target in targets:
            resolved = nearest_module(target, known)
            if resolved is not None and resolved != module:
                found.add(resolved)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the prx_core modules it imports."""
    known = module_names(root)
    return {module: imports_of(module, path, known) for module, path in known.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(start: str) -> None:
        # iterative, so a long chain of imports cannot hit the recursion limit
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


def describe(graph: dict[str, set[str]], component: list[str]) -> str:
    """The component's modules, each with what it imports inside the component."""
    members = set(component)
    return "\n".join(f"  {m} -> {', '.join(sorted(graph[m] & members))}" for m in component)


def test_prx_core_has_no_import_circles() -> None:
    graph = import_graph(PRX_CORE)
    found = circles(graph)
    assert not found, "import circles in prx_core:\n" + "\n\n".join(describe(graph, c) for c in found)


def test_the_walk_sees_lazy_relative_and_type_checking_imports(tmp_path: Path) -> None:
    package = tmp_path / "prx_core" / "pkg"
    package.mkdir(parents=True)
    (tmp_path / "prx_core" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\n")
    (package / "b.py").write_text("def f():\n    from prx_core.pkg.c import g\n")
    (package / "c.py").write_text("import prx_core.pkg.a\n")
    (package / "d.py").write_text("from prx_core.pkg import a\n")
    graph = import_graph(tmp_path / "prx_core")
    assert graph["prx_core.pkg.d"] == {"prx_core.pkg.a"}
    assert circles(graph) == [["prx_core.pkg.a", "prx_core.pkg.b", "prx_core.pkg.c"]]


def private_imports(root: Path) -> list[str]:
    """`module imports other._name` for each private name one module of prx_core takes from another
    (other libraries' privates, e.g. PIL._imaging for the doctor's probe, are theirs to keep)."""
    found = []
    for module, path in module_names(root).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                base = resolve_base(module, path.name == "__init__.py", node)
                found += [f"{module} imports {base}.{alias.name}" for alias in node.names
                          if alias.name.startswith("_") and not alias.name.startswith("__")
                          and base.startswith("prx_core") and base != module]
    return found


def test_no_module_imports_a_private_name_of_another() -> None:
    assert private_imports(PRX_CORE) == []


def test_a_private_import_is_found(tmp_path: Path) -> None:
    package = tmp_path / "prx_core"
    (package / "a").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a" / "__init__.py").write_text("")
    (package / "a" / "x.py").write_text("def _helper() -> None: ...\n")
    (package / "a" / "y.py").write_text("from prx_core.a.x import _helper\nfrom .x import _helper as h\n")
    assert private_imports(package) == ["prx_core.a.y imports prx_core.a.x._helper"] * 2
