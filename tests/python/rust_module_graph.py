"""The module dependency graph of a Rust crate, read from its sources (no compiler needed).

A module depends on another when its code names an item there: a `use` path, or a path in the
code (`crate::a::b::f()`, `super::X`, `child::f()`). Paths are resolved the way rustc resolves
them, as far as a reader can: `crate`, `self` and `super` prefixes, child modules, and the
names a module imports or re-exports (`pub use`), followed to the module that defines the item.
So `use crate::KvEvent` depends on `prefix::events` (where lib.rs's `pub use` points), not on
the crate root; a name the root itself defines (a type alias in lib.rs) is an arrow back up to
the root. Inline modules count as part of their file's module; test-only modules
(`#[cfg(test)] mod tests`) are left out, as the library is built without them. Comments and
string literals are ignored (doc links are not dependencies). Limits, all toward seeing fewer
edges: a glob import names its source module only, and `#[path]` attributes are not followed (no
crate's `src/` uses them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

Module = tuple[str, ...]
"""A module's path from the crate root: () is lib.rs, ("manager", "hybrid") manager/hybrid."""

_IDENT = r"(?:r#)?[A-Za-z_][A-Za-z0-9_]*"
_MOD_DECL = re.compile(rf"\bmod\s+({_IDENT})\s*;")
_MOD_INLINE = re.compile(rf"\bmod\s+({_IDENT})\s*\{{")
_USE = re.compile(r"(?<![\w$])use\s+([^;]*);")
_PATH = re.compile(rf"(?<![\w:$])({_IDENT}(?:\s*::\s*{_IDENT})+)")
_RAW_STRING_START = re.compile(r'(?:b|c)?r(#*)"')


def strip_comments_and_literals(source: str) -> str:
    """`source` with every comment, string, byte-string and char literal blanked out (newlines
    kept), so that only code remains. Lifetimes (`'a`) are kept."""
    out: list[str] = []
    i, n = 0, len(source)

    def blank(text: str) -> str:
        return "".join(c if c == "\n" else " " for c in text)

    while i < n:
        c = source[i]
        if source.startswith("//", i):
            end = source.find("\n", i)
            end = n if end < 0 else end
            out.append(blank(source[i:end]))
            i = end
        elif source.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if source.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif source.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(blank(source[i:j]))
            i = j
        elif (raw := _RAW_STRING_START.match(source, i)) and not _ident_char_before(source, i):
            closing = '"' + raw.group(1)
            end = source.find(closing, raw.end())
            end = n if end < 0 else end + len(closing)
            out.append(blank(source[i:end]))
            i = end
        elif c == '"' or (c in "bc" and source.startswith('"', i + 1) and not _ident_char_before(source, i)):
            j = i + (1 if c == '"' else 2)
            while j < n and source[j] != '"':
                j += 2 if source[j] == "\\" else 1
            out.append(blank(source[i : j + 1]))
            i = j + 1
        elif c == "'" or (c == "b" and source.startswith("'", i + 1) and not _ident_char_before(source, i)):
            j = i + (1 if c == "'" else 2)
            if j < n and source[j] == "\\":
                end = source.find("'", j + 2)
                out.append(blank(source[i : end + 1]))
                i = end + 1
            elif j + 1 < n and source[j + 1] == "'":
                out.append(blank(source[i : j + 2]))
                i = j + 2
            else:  # a lifetime or a label
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _ident_char_before(source: str, i: int) -> bool:
    return i > 0 and (source[i - 1].isalnum() or source[i - 1] == "_")


def expand_use_tree(tree: str) -> list[tuple[list[str], str | None]]:
    """The paths of one `use` tree (`a::{b, c::{d as e, self}, *}`) as (segments, bound name):
    the name is what the import binds in the module (None for a glob or `as _`)."""
    tokens = re.findall(rf"::|[{{}},*]|{_IDENT}", tree)
    results: list[tuple[list[str], str | None]] = []
    at = 0

    def tree_at(prefix: list[str]) -> None:
        # tree := path [as name] | path :: { tree, .. } | path :: * | { tree, .. }
        nonlocal at
        segments = list(prefix)
        while at < len(tokens):
            token = tokens[at]
            if token == "{":
                at += 1
                while at < len(tokens) and tokens[at] != "}":
                    if tokens[at] == ",":
                        at += 1
                        continue
                    tree_at(segments)
                at += 1
                return
            if token == "*":
                at += 1
                results.append((segments, None))
                return
            if token == "::":
                at += 1
                continue
            if token in (",", "}"):
                break
            segments.append(token.removeprefix("r#"))
            at += 1
            if at < len(tokens) and tokens[at] == "as":
                alias = tokens[at + 1]
                at += 2
                _bind(segments, alias)
                return
        _bind(segments, None)

    def _bind(segments: list[str], alias: str | None) -> None:
        if segments and segments[-1] == "self":
            segments = segments[:-1]
        if not segments:
            return
        bound = alias or segments[-1]
        results.append((segments, None if bound == "_" else bound))

    while at < len(tokens):
        if tokens[at] in (",", "::"):
            at += 1
            continue
        tree_at([])
    return results


@dataclass
class _ModuleInfo:
    path: Path
    code: str
    children: set[str] = field(default_factory=set)
    # (module the `use` is in, the name it binds) -> (that module, the use path's segments).
    imports: dict[tuple[Module, str], tuple[Module, list[str]]] = field(default_factory=dict)
    # (module the path is written in, segments): every use path and code path of the file.
    paths: list[tuple[Module, list[str]]] = field(default_factory=list)


@dataclass
class CrateGraph:
    """Every file module of one crate and the dependencies between them."""

    name: str
    modules: dict[Module, Path]
    edges: dict[Module, set[Module]]

    def cycles(self, ignored_edges: frozenset[tuple[Module, Module]] = frozenset()) -> list[list[Module]]:
        """The strongly connected components of more than one module (each a set of modules
        that reach each other), after dropping `ignored_edges`; sorted for stable messages."""
        graph = {m: {t for t in ts if (m, t) not in ignored_edges} for m, ts in self.edges.items()}
        return [sorted(c) for c in _strongly_connected(graph) if len(c) > 1]


def _strongly_connected(graph: dict[Module, set[Module]]) -> list[list[Module]]:
    """Tarjan's algorithm, iteratively (crates are small, but no recursion limit to mind)."""
    index: dict[Module, int] = {}
    low: dict[Module, int] = {}
    on_stack: set[Module] = set()
    stack: list[Module] = []
    components: list[list[Module]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            advanced = False
            for target in targets:
                if target not in index:
                    index[target] = low[target] = counter
                    counter += 1
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                    advanced = True
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            if advanced:
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
                components.append(sorted(component))
    return sorted(components)


_ATTRIBUTES_BEFORE = re.compile(r"((?:#\[[^\]]*\]\s*)*)(?:pub(?:\([^)]*\))?\s+)?$")


def _test_only(code: str, mod_start: int) -> bool:
    """Whether the `mod` item at `mod_start` is compiled for tests only (`#[cfg(test)]`)."""
    attributes = _ATTRIBUTES_BEFORE.search(code[max(0, mod_start - 300) : mod_start])
    return attributes is not None and re.search(r"cfg\(\s*test\s*\)", attributes.group(1)) is not None


def _inline_module_spans(code: str) -> list[tuple[int, int, str, bool]]:
    """(body start, body end, name, test only) of every inline `mod name { .. }`."""
    spans = []
    for match in _MOD_INLINE.finditer(code):
        depth, i = 1, match.end()
        while i < len(code) and depth:
            depth += {"{": 1, "}": -1}.get(code[i], 0)
            i += 1
        spans.append((match.end(), i, match.group(1), _test_only(code, match.start())))
    return spans


def _inline_path(spans: list[tuple[int, int, str, bool]], at: int) -> Module | None:
    """The inline modules around offset `at`, outermost first; None inside test-only code."""
    around = [(name, test) for start, end, name, test in spans if start <= at < end]
    return None if any(test for _, test in around) else tuple(name for name, _ in around)


def _child_file(parent_file: Path, parent_is_dir_owner: bool, name: str) -> Path | None:
    directory = parent_file.parent if parent_is_dir_owner else parent_file.with_suffix("")
    for candidate in (directory / f"{name}.rs", directory / name / "mod.rs"):
        if candidate.is_file():
            return candidate
    return None


def crate_graph(crate_dir: Path) -> CrateGraph:
    """The module graph of the library crate at `crate_dir` (its `src/lib.rs` tree), without
    test-only code (`#[cfg(test)]` modules): what the library itself is built from."""
    infos: dict[Module, _ModuleInfo] = {}
    pending: list[tuple[Module, Path]] = [((), crate_dir / "src" / "lib.rs")]
    while pending:
        module, path = pending.pop()
        code = strip_comments_and_literals(path.read_text(encoding="utf-8"))
        info = _ModuleInfo(path, code)
        infos[module] = info
        spans = _inline_module_spans(code)
        owns_dir = path.name in ("lib.rs", "mod.rs", "main.rs")
        for match in _MOD_DECL.finditer(code):
            name = match.group(1).removeprefix("r#")
            child = _child_file(path, owns_dir, name)
            if child is None or _inline_path(spans, match.start()) != () or _test_only(code, match.start()):
                # Absent (another target's module), inside an inline module, or tests only.
                continue
            info.children.add(name)
            pending.append(((*module, name), child))
        for _, _, name, test in spans:
            if not test:
                info.children.add(name)  # resolvable as a child; folded into this file below
        used_spans = []
        for match in _USE.finditer(code):
            used_spans.append(match.span())
            inline = _inline_path(spans, match.start())
            if inline is None:
                continue
            here = (*module, *inline)
            for segments, bound in expand_use_tree(match.group(1)):
                info.paths.append((here, segments))
                if bound is not None:
                    info.imports[(here, bound)] = (here, segments)
        for match in _PATH.finditer(code):
            inline = _inline_path(spans, match.start())
            if inline is None or any(start <= match.start() < end for start, end in used_spans):
                continue
            info.paths.append(((*module, *inline), re.sub(r"\s+", "", match.group(1)).split("::")))

    file_modules = set(infos)

    def file_module(module: Module) -> Module:
        while module not in file_modules:
            module = module[:-1]
        return module

    def is_module(module: Module) -> bool:
        owner = file_module(module)
        rest = module[len(owner) :]
        return not rest or (len(rest) == 1 and rest[0] in infos[owner].children)

    def lookup_import(module: Module, name: str) -> tuple[Module, list[str]] | None:
        # An inline module (`mod tests`) sees its file module's names too (`use super::*`).
        imports = infos[file_module(module)].imports
        return imports.get((module, name)) or imports.get((file_module(module), name))

    def resolve(here: Module, segments: list[str], depth: int = 0) -> Module | None:
        """The module that defines what `segments` names when written in `here`; None for a
        path outside the crate (std, another crate, an associated item of a type parameter)."""
        if depth > 16 or not segments:
            return None
        first, rest = segments[0], segments[1:]
        if first in ("crate", "$crate"):
            base: Module = ()
        elif first == "self":
            base = here
        elif first == "super":
            base = here[:-1]
            while rest and rest[0] == "super":
                base, rest = base[:-1], rest[1:]
        elif is_module((*here, first)):
            base = (*here, first)
        else:
            imported = lookup_import(here, first)
            if imported is None:
                return None
            return resolve(imported[0], imported[1] + rest, depth + 1)
        for i, segment in enumerate(rest):
            if is_module((*base, segment)):
                base = (*base, segment)
                continue
            # A name `base` imports (a re-export): the module that defines it.
            imported = lookup_import(base, segment)
            if imported is not None:
                return resolve(imported[0], imported[1] + rest[i + 1 :], depth + 1) or base
            break
        return base

    edges: dict[Module, set[Module]] = {module: set() for module in infos}
    for module, info in infos.items():
        for here, segments in info.paths:
            target = resolve(here, segments)
            if target is None:
                continue
            target = file_module(target)
            if target != module:
                edges[module].add(target)
    return CrateGraph(crate_dir.name, {m: i.path for m, i in infos.items()}, edges)


def module_name(module: Module) -> str:
    """`crate::a::b` for ("a", "b"), `crate` for the root."""
    return "::".join(("crate", *module))


def parse_module_name(name: str) -> Module:
    parts = name.split("::")
    assert parts[0] == "crate", name
    return tuple(parts[1:])
