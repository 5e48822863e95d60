"""No import cycle among the project's modules (engine_lib, benchmarks and client together), counting imports
inside functions and relative imports too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine_lib", "benchmarks", "client")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The project modules a file imports anywhere in it (`from a import b` counts a.b when b is a module;
    `from . import b` and `from .a import b` resolve against the file's package)."""
    found = set()
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in modules}
    return found


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
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


def test_no_import_cycle_in_engine_lib_benchmarks_and_client():
    assert find_cycle(graph()) == []


def test_the_checker_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_function_level_imports():
    edges = graph()
    assert "engine_lib.pipelines.registry" in edges["engine_lib.engine"]  # imported inside make_engine
    assert "benchmarks.packing" in edges["benchmarks.run"]  # imported inside run_packing
    assert {"client.api", "engine_lib.config"} & edges["benchmarks.loadgen"] == set()


def test_the_graph_covers_every_package_and_resolves_relative_imports(tmp_path, monkeypatch):
    edges = graph()
    assert {name.split(".")[0] for name in edges} == set(PACKAGES)
    for package in ("a", "a/b"):
        (tmp_path / package).mkdir()
    (tmp_path / "a" / "__init__.py").write_text("from . import x\n")
    (tmp_path / "a" / "x.py").write_text("from .b import y\n")
    (tmp_path / "a" / "b" / "__init__.py").write_text("")
    (tmp_path / "a" / "b" / "y.py").write_text("from .. import x\n")
    files = {"a": tmp_path / "a" / "__init__.py", "a.x": tmp_path / "a" / "x.py",
             "a.b": tmp_path / "a" / "b" / "__init__.py", "a.b.y": tmp_path / "a" / "b" / "y.py"}
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    found = {name: imports_of(path, set(files)) - {name} for name, path in files.items()}
    assert found == {"a": {"a.x"}, "a.x": {"a.b", "a.b.y"}, "a.b": set(), "a.b.y": {"a", "a.x"}}
    assert find_cycle(found) == ["a", "a.x", "a.b.y", "a"]


def test_tests_import_shared_code_from_tests_helpers_only():
    """A test module or conftest imported as a module runs its fixtures and tests twice under another name:
    what tests share lives in tests/helpers, imported as `tests.helpers.<module>`."""
    offenders = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else
                     ["." * node.level] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                last = name.split(".")[-1]
                if name.startswith(".") or last == "conftest" or last.startswith("test_") or (
                        name.startswith("tests.") and not name.startswith("tests.helpers")):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    assert offenders == []
