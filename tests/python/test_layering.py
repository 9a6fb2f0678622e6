"""The Python package has no import cycles, and its layers point one way: the command line
(`pagedkv.cli`, `pagedkv.commands`) uses the library, never the reverse.

Every ``import`` counts, the ones inside functions too: a lazy import hides a cycle from the
interpreter, not from a reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pagedkv

PACKAGE_DIR = Path(pagedkv.__file__).resolve().parent
CLI_LAYER = ("pagedkv.cli", "pagedkv.commands", "pagedkv.__main__")


def _module_name(path: Path) -> str:
    parts = ("pagedkv", *path.relative_to(PACKAGE_DIR).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    modules = {_module_name(path): path for path in PACKAGE_DIR.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(
                        [*package.split(".")[: len(package.split(".")) - node.level + 1], base]
                    ).strip(".")
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and target.startswith("pagedkv"):
                    graph[name].add(target)
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph[node]):
            # A module's own package (its __init__) is imported first by Python anyway.
            if node.startswith(target + "."):
                continue
            if state.get(target) == 1:
                return stack[stack.index(target) :] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycles():
    graph = _import_graph()
    assert len(graph) > 40 and "pagedkv.sim.builders" in graph["pagedkv.commands.simulation"]
    cycle = _find_cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_the_library_never_imports_the_command_line():
    graph = _import_graph()
    for module, targets in graph.items():
        if module.startswith(CLI_LAYER):
            continue
        assert not [t for t in targets if t.startswith(CLI_LAYER)], module


def test_the_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def _reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for target in graph[todo.pop()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


# The engine's two halves (docs/engine.md, "One step"): the scheduler plans on the block
# manager; the model runner holds the K/V arrays and moves data. Modules that hold or move K/V:
KV_DATA_MODULES = (
    "pagedkv.engine.kv_store",
    "pagedkv.engine.host_cache",
    "pagedkv.engine.store_saves",
    "pagedkv.engine.model_runner",
    "pagedkv.attention",
    "pagedkv.models",
)


# Under pagedkv.attention but holding no K/V: byte accounting of the cache dtypes (names and sizes),
# which the store keys (the scheduler's store lookup) validate their dtype against.
KV_ACCOUNTING_MODULES = frozenset({"pagedkv.attention.kv_cache_dtype"})


def test_the_model_runner_never_imports_the_scheduler():
    graph = _import_graph()
    assert "pagedkv.engine.scheduled_batch" in graph["pagedkv.engine.model_runner"]
    reached = _reaches(graph, "pagedkv.engine.model_runner")
    assert "pagedkv.engine.scheduler" not in reached
    assert "pagedkv.engine.store_lookup" not in reached


def test_the_scheduler_reaches_no_module_that_holds_or_moves_kv():
    graph = _import_graph()
    reached = _reaches(graph, "pagedkv.engine.scheduler")
    assert "pagedkv.engine.scheduled_batch" in reached
    touched = sorted(m for m in reached if m.startswith(KV_DATA_MODULES) and m not in KV_ACCOUNTING_MODULES)
    assert not touched, touched


def test_the_reach_finder_follows_imports():
    assert _reaches({"a": {"b"}, "b": {"c"}, "c": set()}, "a") == {"b", "c"}


def test_the_engine_never_imports_its_benchmarks():
    graph = _import_graph()
    assert "pagedkv.benchmarks.engine" in graph["pagedkv.commands.engine"]
    assert not [m for m in graph if m.startswith("pagedkv.engine.bench")]
    for module in (m for m in graph if m.startswith("pagedkv.engine")):
        assert not [t for t in _reaches(graph, module) if t.startswith("pagedkv.benchmarks")], module
