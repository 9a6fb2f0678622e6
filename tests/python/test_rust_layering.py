"""No Rust crate of the workspace has an import cycle between its modules (the Rust side of
test_layering.py; the graph is read from the sources by rust_module_graph.py).

Two views, both must be acyclic:

* **modules**: one node per file module (`manager/batch.rs`, `manager/mod.rs`, ...), an edge
  where a module's code names an item another module defines (re-exports followed to the
  definition). A child that names its parent's items while the parent names the child's is a
  cycle here, as in `attention_simd` <-> `attention_avx2` before they were split into folders.
* **siblings**: for each module, the graph between the subtrees of its children: `a` reaches
  `b` when any module under `a` names one under `b`. This is where `prefix` <-> `offload_tier`
  shows: `offload_tier` uses `prefix::lru`, `prefix` uses `offload_tier`.

Known cycles that predate this check were listed edge by edge in ``KNOWN_CYCLE_EDGES``, each with
its reason; the check drops those edges and requires the rest to be acyclic. An entry whose edge
is gone or no longer closes a cycle fails the check too, so the list only ever shrinks. It is
empty now: the core crate's last ones (manager/'s operation files and the struct in mod.rs,
prefix <-> offload_tier) went when the manager's state moved to the leaf manager/state.rs and
the offload tier became an ``EvictionSink`` of prefix/eviction.rs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from rust_module_graph import (
    CrateGraph,
    Module,
    crate_graph,
    module_name,
    parse_module_name,
    strip_comments_and_literals,
)

RUST_DIR = Path(__file__).resolve().parents[2] / "rust"
CRATES = sorted(path.name for path in RUST_DIR.iterdir() if (path / "src" / "lib.rs").is_file())

KNOWN_CYCLE_EDGES: dict[tuple[str, str], str] = {}


def _known_edges(crate: str) -> frozenset[tuple[Module, Module]]:
    edges = set()
    for (name, edge), _reason in KNOWN_CYCLE_EDGES.items():
        if name == crate:
            source, _, target = edge.partition(" -> ")
            edges.add((parse_module_name(source), parse_module_name(target)))
    return frozenset(edges)


def _sibling_cycles(graph: CrateGraph, ignored: frozenset[tuple[Module, Module]]) -> list[str]:
    """Cycles between the subtrees of one module's children, described with the module edges
    that close them."""
    found = []
    for parent in sorted(graph.modules):
        children = [m for m in graph.modules if len(m) == len(parent) + 1 and m[: len(parent)] == parent]
        if len(children) < 2:
            continue

        def child_of(module: Module, parent: Module = parent) -> Module | None:
            inside = len(module) > len(parent) and module[: len(parent)] == parent
            return module[: len(parent) + 1] if inside else None

        edges: dict[Module, set[Module]] = {child: set() for child in children}
        evidence: dict[tuple[Module, Module], list[str]] = {}
        for source, targets in graph.edges.items():
            for target in targets:
                a, b = child_of(source), child_of(target)
                if a is None or b is None or a == b or (source, target) in ignored:
                    continue
                edges[a].add(b)
                evidence.setdefault((a, b), []).append(f"{module_name(source)} -> {module_name(target)}")
        sub = CrateGraph(graph.name, {c: graph.modules[c] for c in children}, edges)
        for cycle in sub.cycles():
            links = [
                f"{module_name(a)} -> {module_name(b)} ({', '.join(sorted(evidence[(a, b)]))})"
                for a in cycle
                for b in sorted(edges[a])
                if b in cycle
            ]
            found.append("; ".join(links))
    return found


def _module_cycles(graph: CrateGraph, ignored: frozenset[tuple[Module, Module]]) -> list[str]:
    found = []
    for cycle in graph.cycles(ignored):
        links = [
            f"{module_name(a)} -> {module_name(b)}"
            for a in cycle
            for b in sorted(graph.edges[a])
            if b in cycle and (a, b) not in ignored
        ]
        found.append("; ".join(links))
    return found


@pytest.fixture(scope="module")
def graphs() -> dict[str, CrateGraph]:
    return {crate: crate_graph(RUST_DIR / crate) for crate in CRATES}


def test_every_crate_is_read(graphs):
    assert {"pagedkv", "pagedkv-cpu", "pagedkv-python", "pagedkv-sim"} <= set(graphs)
    core = graphs["pagedkv"]
    assert len(core.modules) > 40
    # Edges the reader must see: a plain `use`, a re-export followed to its definition (the id
    # types the root re-exports from types.rs), and a `super::` path.
    assert ("pool",) in core.edges[("manager", "state")]
    assert ("types",) in core.edges[("table",)]
    assert ("manager", "state") in core.edges[("manager", "admission")]
    cpu = graphs["pagedkv-cpu"]
    assert ("attention", "portable") in cpu.edges[("attention", "avx2")]


@pytest.mark.parametrize("crate", CRATES)
def test_no_cycle_between_modules(graphs, crate):
    cycles = _module_cycles(graphs[crate], _known_edges(crate))
    assert not cycles, f"{crate}: import cycles between modules: " + " | ".join(cycles)


@pytest.mark.parametrize("crate", CRATES)
def test_no_cycle_between_sibling_subtrees(graphs, crate):
    cycles = _sibling_cycles(graphs[crate], _known_edges(crate))
    assert not cycles, f"{crate}: import cycles between sibling modules' subtrees: " + " | ".join(cycles)


def test_every_known_cycle_edge_is_still_needed(graphs):
    for (crate, edge), reason in KNOWN_CYCLE_EDGES.items():
        assert reason
        source, _, target = edge.partition(" -> ")
        a, b = parse_module_name(source), parse_module_name(target)
        graph = graphs[crate]
        assert b in graph.edges.get(a, set()), f"{crate}: {edge} no longer exists: remove it from the list"
        others = _known_edges(crate) - {(a, b)}
        closes = _module_cycles(graph, others) or _sibling_cycles(graph, others)
        assert closes, f"{crate}: {edge} no longer closes a cycle: remove it from the list"


def _write_crate(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "src" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


def test_the_reader_finds_each_kind_of_cycle(tmp_path):
    # Siblings through `use crate::`, with the cycle only in comments and strings elsewhere.
    siblings = crate_graph(
        _write_crate(
            tmp_path / "siblings",
            {
                "lib.rs": "mod a;\nmod b;\nmod c;\n",
                "a.rs": "use crate::b::B;\npub struct A;\n",
                "b.rs": "pub struct B;\npub fn f() -> usize { super::a::A; 0 }\n",
                "c.rs": '// use crate::a::A;\nconst S: &str = "crate::a::A";\nconst C: char = \'"\';\n',
            },
        )
    )
    assert siblings.cycles() == [[("a",), ("b",)]]
    assert siblings.edges[("c",)] == set()
    # A child naming its parent's item while the parent uses the child's.
    parent_child = crate_graph(
        _write_crate(
            tmp_path / "parent",
            {
                "lib.rs": "mod p;\n",
                "p/mod.rs": "mod kid;\nuse kid::K;\npub struct P;\n",
                "p/kid.rs": "pub struct K(super::P);\n",
            },
        )
    )
    assert parent_child.cycles() == [[("p",), ("p", "kid")]]
    # Resolved through a re-export: `crate::T` names t.rs, not the root; test-only code is left
    # out; a leaf shared by both sides breaks the cycle.
    reexport = crate_graph(
        _write_crate(
            tmp_path / "reexport",
            {
                "lib.rs": "mod t;\nmod u;\npub use t::{T as Renamed, T};\npub use u::U;\n",
                "t.rs": "pub type T = u32;\n#[cfg(test)]\nmod tests {\n    use crate::u::U;\n}\n",
                "u.rs": "use crate::{Renamed, T};\npub struct U(T, Renamed);\n",
            },
        )
    )
    assert reexport.edges[("u",)] == {("t",)}
    assert reexport.edges[()] == {("t",), ("u",)}
    assert reexport.cycles() == []
    # Sibling subtrees: x uses a leaf of y, y's own module uses x.
    subtrees = crate_graph(
        _write_crate(
            tmp_path / "subtrees",
            {
                "lib.rs": "mod x;\nmod y;\n",
                "x.rs": "use crate::y::leaf::L;\npub struct X(L);\n",
                "y/mod.rs": "pub mod leaf;\nuse crate::x::X;\n",
                "y/leaf.rs": "pub struct L;\n",
            },
        )
    )
    assert subtrees.cycles() == []
    assert _sibling_cycles(subtrees, frozenset()) == [
        "crate::x -> crate::y (crate::x -> crate::y::leaf); crate::y -> crate::x (crate::y -> crate::x)"
    ]


def test_comments_and_literals_are_blanked():
    code = (
        'let a = "x // y"; // c::d\nlet b = r#"e::f"#; /* g /* h */ i::j */ let c = \'k\'; let d: &\'a str;'
    )
    stripped = strip_comments_and_literals(code)
    for gone in ("c::d", "e::f", "i::j", "x // y", "'k'"):
        assert gone not in stripped
    assert "let d: &'a str;" in stripped
    assert stripped.count("\n") == code.count("\n")
