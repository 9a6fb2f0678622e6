"""The pagedkv command line: the demo, the simulator and the experiments.

'pagedkv demo' (no arguments) is the main job: the whole PagedAttention story in a few seconds.
Every command prints tables; '--json FILE' writes its numbers and '--plot FILE' a PNG.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
from collections.abc import Callable
from typing import Any

import pagedkv
from pagedkv.commands import cluster as cluster_commands
from pagedkv.commands import costmodel as costmodel_commands
from pagedkv.commands import disagg as disagg_commands
from pagedkv.commands import engine as engine_commands
from pagedkv.commands import experiments as experiment_commands
from pagedkv.commands import simulation as simulation_commands
from pagedkv.commands import viz as viz_commands
from pagedkv.commands.args import CliError
from pagedkv.commands.output import write_json
from pagedkv.errors import PagedKvError

__all__ = ["COMMANDS", "CliError", "build_parser", "main", "write_json"]

# The registration point: each entry adds its subcommands to the parser (``register(subparsers)``,
# setting ``handler=`` on each). A new command group is one module with a ``register`` and one
# line here; `pagedkv.commands` describes the contract.
COMMANDS: list[Callable[[Any], None]] = [
    experiment_commands.register,  # demo, figure2, sharing
    simulation_commands.register,  # simulate, sweep, compare, recovery
    costmodel_commands.register,  # costmodel
    viz_commands.register,  # viz
    engine_commands.register,  # generate, bench-engine
    cluster_commands.register,  # cluster
    disagg_commands.register,  # disagg
]

# Commands that time NumPy work: BLAS threads spinning on a busy machine make timings erratic.
_SINGLE_THREADED_BLAS = ("costmodel", "demo", "generate", "bench-engine", "disagg")


class _Parser(argparse.ArgumentParser):
    """No abbreviated options: ``sweep --block-size 32`` must be refused (sweep takes
    ``--block-sizes``), not read as ``--block-sizes 32``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pagedkv", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"pagedkv {pagedkv.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for register in COMMANDS:
        register(subparsers)
    return parser


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout is not a file (captured in tests)
        pass


def _stdout_closed() -> bool:
    """Whether standard output was closed when we started (``pagedkv demo >&-``): Python then sets
    ``sys.stdout`` to None and every ``print`` silently does nothing. A stream without a file
    descriptor (captured in tests) counts as open."""
    stream = sys.stdout
    if stream is None:
        return True
    try:
        os.fstat(stream.fileno())
    except (AttributeError, ValueError, io.UnsupportedOperation):
        return False
    except OSError:
        return True
    return False


def main(argv: list[str] | None = None) -> int:
    """Run ``pagedkv`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status: 0 on
    success, 2 on a usage error, a refused input or an unusable output (one line on stderr, no
    traceback)."""
    if _stdout_closed():  # every command prints its results: refuse before running for nothing
        print("pagedkv: error: standard output is closed", file=sys.stderr)
        return 2
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # a usage error (already printed), --help or --version
        return exit_.code if isinstance(exit_.code, int) else 2
    if args.command is None:
        parser.print_help()
        return 0
    if args.command in _SINGLE_THREADED_BLAS and "numpy" not in sys.modules:
        for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(variable, "1")
    try:
        status = int(args.handler(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return status
    except BrokenPipeError:
        # `pagedkv sweep | head`: the reader left. Exit quietly, as Unix tools do (128 + SIGPIPE),
        # with stdout pointed at /dev/null so that the final flush at exit cannot fail again.
        _silence_stdout()
        return 141
    except (PagedKvError, OSError) as error:
        print(f"pagedkv {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"pagedkv {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
