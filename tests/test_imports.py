"""No import cycle among engine_lib's modules, counting imports inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "engine_lib"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The engine_lib modules a file imports anywhere in it (`from a import b` counts a.b when b is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in modules}
    return found


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imports_of(path, set(files)) - {name} for name, path in files.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str]:
    """One import cycle as a path of module names, or [] (depth-first search)."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = "done"
        return []

    for node in sorted(edges):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return []


def test_engine_lib_has_no_import_cycle():
    assert find_cycle(graph()) == []


def test_the_checker_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_function_level_imports():
    edges = graph()
    assert "engine_lib.pipelines.registry" in edges["engine_lib.engine"]  # imported inside make_engine
