"""The house rules that keep `hybridrl/` readable: imports point down the layers (no cycle, also none hidden
inside a function), no file past 600 lines, and packages at most two levels below `hybridrl/`."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hybridrl"
MAX_LINES = 600


def module_files(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every module and package under `root`."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its file (function bodies included, so a cycle
    hidden by a function-level import counts). `from pkg import sub` is an edge to `pkg.sub` alone."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                submodules = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
                targets = submodules or [base]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_find_cycles_sees_a_cycle_through_a_function_level_import(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg import b\n")
    (package / "b.py").write_text("def f():\n    from pkg.a import g\n")
    (package / "c.py").write_text("import pkg.a\n")
    cycles = find_cycles(import_graph(module_files(package)))
    assert cycles == [["pkg.a", "pkg.b"]]


def test_no_import_cycles():
    cycles = find_cycles(import_graph(module_files()))
    assert not cycles, "import cycles (make the lower module not import the higher one): " + "; ".join(
        " <-> ".join(cycle) for cycle in cycles)


def test_no_file_over_600_lines():
    long = {str(path.relative_to(PACKAGE.parent)): n for path in PACKAGE.rglob("*.py")
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these modules (over {MAX_LINES} lines): {long}"


def test_packages_at_most_two_levels_deep_and_each_says_its_job():
    for init in PACKAGE.rglob("__init__.py"):
        depth = len(init.parent.relative_to(PACKAGE).parts)
        assert depth <= 2, f"{init.parent} is {depth} levels below hybridrl/; keep packages at most two deep."
        docstring = ast.get_docstring(ast.parse(init.read_text()))
        assert docstring, f"{init} needs a docstring saying what the package is for."
