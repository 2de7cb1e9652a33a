"""No import cycles in hybridflow/ and engines/, read from the source with `ast` (nothing is imported).

Every import statement counts, module level or inside a function: a lazy import still makes one
module depend on the other. `from pkg import name` depends on `pkg.name` when that is a module.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("hybridflow", "engines")


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    paths = (path for package in packages for path in sorted((root / package).rglob("*.py")))
    return {_module_name(path, root): path for path in paths}


def _nearest_module(name: str, modules: dict[str, Path]) -> str | None:
    """`name` or its longest prefix that is one of our modules (`a.b.func` -> `a.b`)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _from_source(package: str, node: ast.ImportFrom) -> str:
    """The module a `from ... import` reads from, leading dots resolved against `package`."""
    if not node.level:
        return node.module
    base = package.rsplit(".", node.level - 1)[0]
    return f"{base}.{node.module}" if node.module else base


def _imported_names(module: str, path: Path) -> list[str]:
    """Every name an import statement of `path` names, `from a import b` as `a.b`."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names += [f"{_from_source(package, node)}.{alias.name}" for alias in node.names]
    return names


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """module -> the modules of `packages` it imports."""
    modules = _modules(root, packages)
    return {
        module: {
            target
            for name in _imported_names(module, path)
            if (target := _nearest_module(name, modules)) is not None
        }
        for module, path in modules.items()
    }


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), list(graph[start])
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo += graph[node]
    return seen


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module, and modules that import themselves."""
    reach = {module: _reachable(graph, module) for module in graph}
    cycles = {
        tuple(sorted(other for other in reach[module] if module in reach[other]))
        for module in graph
        if module in reach[module]
    }
    return sorted(list(cycle) for cycle in cycles)


def _describe(graph: dict[str, set[str]], cycle: list[str]) -> str:
    """The cycle's modules, then each import between two of them."""
    edges = [(module, target) for module in cycle for target in sorted(graph[module] & set(cycle))]
    return " <-> ".join(cycle) + "".join(f"\n    {module} -> {target}" for module, target in edges)


def test_the_graph_counts_lazy_relative_and_from_package_imports(tmp_path):
    files = {
        "__init__.py": "",
        "a.py": "def f():\n    from pkg import b\n",  # lazy, `from pkg import <module>`
        "b.py": "from . import c\n",  # relative
        "c.py": "import pkg.a.f\n",  # an attribute of pkg.a: the edge goes to pkg.a
        "d.py": "from pkg.d import x\n",  # a self-loop
        "e.py": "from pkg.a import f\n",  # imports the cycle, not part of it
    }
    (tmp_path / "pkg").mkdir()
    for name, text in files.items():
        (tmp_path / "pkg" / name).write_text(text)
    assert import_cycles(import_graph(tmp_path, ("pkg",))) == [["pkg.a", "pkg.b", "pkg.c"], ["pkg.d"]]


def test_no_import_cycles_in_hybridflow_or_engines():
    graph = import_graph()
    cycles = import_cycles(graph)
    assert cycles == [], "import cycles:\n" + "\n".join(_describe(graph, cycle) for cycle in cycles)
