"""What commands write: the ``--json`` file and the ``--plot`` PNG, both checked before the run.

A run can take minutes; a path that cannot be written is refused before it starts, not after.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
from collections.abc import Callable
from typing import Any

from pagedkv.commands.args import CliError
from pagedkv.errors import InvalidArgumentTypeError

__all__ = [
    "MATPLOTLIB_ADVICE",
    "check_json_path",
    "check_plot_path",
    "check_outputs",
    "write_json",
    "finish",
    "progress_enabled",
]

# pagedkv is installed from source (a checkout), so the extra is named by path, not by registry.
MATPLOTLIB_ADVICE = (
    "--plot needs matplotlib: pip install matplotlib (or, in a pagedkv checkout, pip install '.[plot]')"
)


def _check_writable(option: str, path: str) -> None:
    if not path:
        raise CliError(f"{option}: the file name is empty")
    if os.path.isdir(path):
        raise CliError(f"{option} {path!r} is a directory; give a file name")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise CliError(f"{option} {path!r}: folder {directory!r} does not exist")
    # Try it: permission bits say nothing to root, and a read-only file system says nothing to
    # os.access. An existing file is opened for appending (unchanged); a new one is created and
    # removed again.
    existed = os.path.exists(path)
    try:
        with open(path, "a" if existed else "x", encoding="utf-8"):
            pass
        if not existed:
            os.remove(path)
    except OSError as error:
        raise CliError(f"{option} {path!r} cannot be written: {error.strerror or error}") from None


def check_json_path(path: str | None) -> None:
    """Refuse a ``--json`` file that could not be written after the run."""
    if path is not None:
        _check_writable("--json", path)


def check_plot_path(path: str | None) -> None:
    """Refuse a ``--plot`` file that could not be written after the run (or without matplotlib)."""
    if path is None:
        return
    _check_writable("--plot", path)
    if not path.lower().endswith(".png"):
        raise CliError(f"--plot {path!r}: the plot is a PNG, give a file name ending in .png")
    if importlib.util.find_spec("matplotlib") is None:
        raise CliError(MATPLOTLIB_ADVICE)


def check_outputs(args: argparse.Namespace) -> None:
    """`check_json_path` and `check_plot_path` for the command's ``--json`` and ``--plot``."""
    check_json_path(getattr(args, "json", None))
    check_plot_path(getattr(args, "plot", None))


def _json_default(value: Any) -> Any:
    import numpy as np

    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    raise InvalidArgumentTypeError(f"cannot write {type(value).__name__} as JSON")


def write_json(path: str, data: Any) -> None:
    """Write ``data`` (NumPy values and dataclasses allowed) as indented JSON."""
    check_json_path(path)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2, default=_json_default)
        handle.write("\n")


def finish(args: argparse.Namespace, data: Any, plot: Callable[[str], None] | None) -> int:
    """Write ``--json`` and ``--plot`` (``plot(path)`` draws it) after a run; exit status 0."""
    if args.json:
        write_json(args.json, data)
        print(f"\nwrote {args.json}")
    if args.plot and plot is not None:
        plot(args.plot)
        print(f"wrote {args.plot}")
    return 0


def progress_enabled(args: argparse.Namespace) -> bool:
    """Whether to draw progress bars (not with ``--no-progress``)."""
    return not getattr(args, "no_progress", False)
