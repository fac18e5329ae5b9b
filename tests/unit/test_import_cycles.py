"""The `ballast` package has no import cycle, counting imports made inside functions too.

A cycle works only while every module on it is first imported in one order, and a function-level
import that closes one hides the dependency instead of removing it. The graph is read from the
source with `ast`: one node per module, an edge for every `import`/`from ... import` of a ballast
module anywhere in the file (a `from pkg import name` is an edge to `pkg.name` when that is a
module, else to `pkg`). Executing a parent package's `__init__` on the way to a submodule is not
an edge: Python has that parent in `sys.modules` already while its submodules load.
"""

import ast
from pathlib import Path
from typing import Dict, List, Set

PKG = Path(__file__).resolve().parents[2] / "ballast"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> Dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(module: str, path: Path, modules: Dict[str, Path]) -> Set[str]:
    """The ballast modules `module` imports, anywhere in its source."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(node, module, path.name == "__init__.py")
            names = [f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:  # `import a.b.c` of a non-module attribute: its module
                name = name.rpartition(".")[0]
            if name.startswith("ballast") and name != module:
                found.add(name)
    return found


def import_graph() -> Dict[str, Set[str]]:
    modules = _modules()
    return {name: _targets(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """One cycle through each strongly connected component of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    components: List[List[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_cycle_in(graph, set(c), c[0]) for c in components]


def _cycle_in(graph: Dict[str, Set[str]], component: Set[str], start: str) -> List[str]:
    """A shortest path start -> ... -> start inside one strongly connected component (breadth first)."""
    parents = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while parents[path[-1]] is not None:
                        path.append(parents[path[-1]])
                    return list(reversed(path)) + [start]
                if w not in parents:
                    parents[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"{start} is on no cycle of its component")


def test_the_cycle_finder_sees_a_function_level_cycle_and_nothing_else():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_holds_function_level_and_relative_imports():
    graph = import_graph()
    # main.py imports the driver loop inside a function only; micro_batch.py imports its siblings relatively.
    assert "ballast.trainer.ray_trainer" in graph["ballast.trainer.main"]
    assert {"ballast.balance.packing", "ballast.balance.workload"} <= graph["ballast.balance.micro_batch"]
    assert all(t.startswith("ballast") and t in graph for targets in graph.values() for t in targets)


def test_ballast_has_no_import_cycle():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)
