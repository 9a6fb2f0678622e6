"""One home for errors: every exception class the package defines lives in ``pagedkv.errors``
(the old homes import it from there), and no module raises a bare ``ValueError`` or
``RuntimeError`` (each refusal is a ``pagedkv.errors`` class; ``InvalidArgumentError`` is still
a ``ValueError`` and ``ClosedError`` a ``RuntimeError`` for callers that catch those).

Read from the source (every ``class`` and ``raise`` statement, including lazily imported
modules), not from what happens to be imported."""

from __future__ import annotations

import ast
import builtins
import inspect
from pathlib import Path

import pagedkv
import pagedkv.errors
import pytest

PACKAGE_DIR = Path(pagedkv.__file__).resolve().parent
# Built-ins the package never raises bare. TypeError and the rest stay allowed where a
# protocol demands them (a module ``__getattr__`` raises AttributeError).
FORBIDDEN = {"ValueError", "RuntimeError", "TypeError", "Exception", "KeyError", "IndexError"}


def _sources(root: Path) -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text(encoding="utf-8"))) for p in sorted(root.rglob("*.py"))]


def _error_names() -> set[str]:
    return {
        name
        for name, obj in vars(pagedkv.errors).items()
        if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == "pagedkv.errors"
    }


def _exception_classes_outside_errors(root: Path = PACKAGE_DIR) -> list[str]:
    """Classes whose bases name an exception (a built-in one or one of pagedkv.errors), defined
    anywhere but pagedkv/errors.py."""
    exception_names = _error_names() | {
        n for n, obj in vars(builtins).items() if inspect.isclass(obj) and issubclass(obj, BaseException)
    }
    found = []
    for path, tree in _sources(root):
        if path == root / "errors.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                if bases & exception_names:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name}")
    return found


def _bare_raises(root: Path = PACKAGE_DIR) -> list[str]:
    found = []
    for path, tree in _sources(root):
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(exc, ast.Name) and exc.id in FORBIDDEN:
                    found.append(f"{path.relative_to(root)}:{node.lineno} raise {exc.id}")
    return found


def test_every_exception_class_is_in_pagedkv_errors():
    assert _exception_classes_outside_errors() == []
    names = _error_names()
    # The 12 of the allocator and data plane, the 11 that lived elsewhere, ClosedError, and the
    # two of KV transfer.
    assert len(names) == 28 and set(pagedkv.errors.__all__) == names
    for name in names:
        assert issubclass(getattr(pagedkv.errors, name), pagedkv.errors.PagedKvError), name


def test_old_homes_import_the_same_classes():
    from pagedkv.commands.args import CliError
    from pagedkv.kernels.emulation import EmulationBuildError, KernelLaunchError
    from pagedkv.kernels.nvrtc import NvrtcCompileError, NvrtcUnavailable
    from pagedkv.sim.traces import TraceError, TraceNotFoundError

    e = pagedkv.errors
    assert (CliError, EmulationBuildError, KernelLaunchError) == (
        e.CliError,
        e.EmulationBuildError,
        e.KernelLaunchError,
    )
    assert (NvrtcCompileError, NvrtcUnavailable) == (e.NvrtcCompileError, e.NvrtcUnavailable)
    assert (TraceError, TraceNotFoundError) == (e.TraceError, e.TraceNotFoundError)
    models = pytest.importorskip("pagedkv.models")
    assert (models.ModelLoadError, models.UnsupportedModelError, models.ChatTemplateError) == (
        e.ModelLoadError,
        e.UnsupportedModelError,
        e.ChatTemplateError,
    )


def test_no_bare_builtin_raise():
    assert _bare_raises() == []


def test_the_scans_find_what_they_look_for(tmp_path):
    """The scans are not vacuous: a stray exception class and a bare raise are found."""
    (tmp_path / "errors.py").write_text("class Fine(Exception):\n    pass\n")
    (tmp_path / "sim").mkdir()
    (tmp_path / "sim" / "stray.py").write_text(
        "class Oops(ValueError):\n    pass\n\n\ndef f():\n    raise RuntimeError('x')\n"
    )
    assert _exception_classes_outside_errors(tmp_path) == ["sim/stray.py:1 Oops"]
    assert _bare_raises(tmp_path) == ["sim/stray.py:6 raise RuntimeError"]
