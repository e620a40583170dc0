"""The import graph of conductor/, assets/ and pipelines/ has no cycle: no module
imports one that imports it back, directly or through others, and the same holds
between packages (conductor's subpackages and top-level modules, assets, pipelines).
Imports inside functions count (they run too); imports under `if TYPE_CHECKING:`
do not. Read from the source with ast, so nothing is imported to check it."""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("conductor", "assets", "pipelines")


@lru_cache(maxsize=1)
def _modules() -> dict[str, Path]:
    mods = {}
    for root in ROOTS:
        for path in (REPO / root).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


@lru_cache(maxsize=1)
def import_graph() -> dict[str, set[str]]:
    """module -> the modules of ROOTS it imports. `from pkg import sub` imports the
    submodule `pkg.sub`; `from pkg import name` imports `pkg`."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_nodes(tree)
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
                for a in node.names:
                    deps.add(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base)
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def package_of(module: str) -> str:
    """assets, pipelines, or conductor's own subpackage or top-level module."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "conductor" else parts[0]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _explain(graph: dict[str, set[str]], comp: list[str]) -> str:
    inside = set(comp)
    return "; ".join(f"{a} -> {', '.join(sorted(graph[a] & inside))}" for a in comp if graph.get(a, set()) & inside)


def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles: " + " | ".join(_explain(graph, c) for c in found)


def test_no_package_imports_one_that_imports_it_back():
    modules = import_graph()
    graph: dict[str, set[str]] = {}
    for m, deps in modules.items():
        graph.setdefault(package_of(m), set()).update(package_of(d) for d in deps if package_of(d) != package_of(m))
    found = cycles(graph)
    details = []
    for comp in found:
        inside = set(comp)
        edges = [f"{m} -> {d}" for m, deps in sorted(modules.items()) for d in sorted(deps)
                 if package_of(m) in inside and package_of(d) in inside and package_of(m) != package_of(d)]
        details.append(", ".join(edges))
    assert not found, "package cycles: " + " | ".join(details)


def test_front_ends_import_downward_only():
    """conductor/ never imports Dagster or the front ends; assets/ never imports pipelines/."""
    for m, deps in import_graph().items():
        if m.startswith("conductor"):
            assert not {d for d in deps if d.split(".")[0] in ("assets", "pipelines")}, m
        if m.startswith("assets"):
            assert not {d for d in deps if d.startswith("pipelines")}, m
    for name, path in _modules().items():
        if name.startswith("conductor"):
            tree = ast.parse(path.read_text())
            imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
            assert not {i for i in imported if i.split(".")[0] == "dagster"}, name


def test_the_checker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
