"""``pagedkv viz``: record the grid of runs and write (and optionally serve) the page.

``pagedkv.cli`` registers the command with :func:`register`, which gives :func:`add_parser` the
shared workload, engine and output option parents of `pagedkv.commands.args`, so ``viz`` takes
the same ``--workload``/``--num-slots``/``--arrival``/... options as ``simulate``. The defaults
differ where a picture needs them to: a pool of 2048 slots (every slot visible), requests of at
most 512 tokens, 200 requests, 300 steps.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from pagedkv.commands import args as cli_args
from pagedkv.errors import InvalidArgumentError
from pagedkv.viz import record

DEFAULT_OUT = "pagedkv-viz.html"
SEEDS_PER_PAGE = 3


def register(subparsers: Any) -> None:
    """Add ``viz`` to the ``pagedkv`` subparsers (the `pagedkv.cli.COMMANDS` contract)."""
    add_parser(
        subparsers, [cli_args.workload_options(), cli_args.engine_options(), cli_args.output_options()]
    )


def add_parser(subparsers: Any, parents: Sequence[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add ``viz`` to ``subparsers``; ``parents`` are the CLI's shared option parsers."""
    parser = subparsers.add_parser(
        "viz",
        parents=list(parents),
        help="interactive HTML page: the block pool, block tables and waste, step by step",
        description=(
            "Replay one workload for every allocator x block size x seed on the same pool and write "
            "one self-contained HTML page (works offline) to step through them. --allocator, "
            "--block-size and --seed choose the run shown first; --json writes every run's summary."
        ),
    )
    group = parser.add_argument_group("visualizer")
    group.add_argument(
        "--allocators",
        default=",".join(record.DEFAULT_ALLOCATORS),
        help="comma-separated allocators to record (default: %(default)s)",
    )
    group.add_argument(
        "--block-sizes",
        default=",".join(map(str, record.DEFAULT_BLOCK_SIZES)),
        help="comma-separated block sizes in tokens (default: %(default)s)",
    )
    group.add_argument(
        "--seeds",
        default=None,
        help=f"comma-separated workload seeds (default: --seed and the next {SEEDS_PER_PAGE - 1})",
    )
    group.add_argument("--out", default=DEFAULT_OUT, help="HTML file to write (default: %(default)s)")
    group.add_argument(
        "--no-compress",
        action="store_true",
        help="embed the runs as plain JSON (bigger; for browsers without DecompressionStream)",
    )
    group.add_argument(
        "--serve",
        action="store_true",
        help="then serve the page on http://127.0.0.1 and print the URL (Ctrl-C stops)",
    )
    group.add_argument(
        "--port",
        type=cli_args.bounded_int(0, 65535),
        default=0,
        help="port for --serve (default: any free port)",
    )
    group.add_argument(
        "--serve-seconds",
        type=cli_args.positive_float,
        default=None,
        help="stop serving after this many seconds (default: until Ctrl-C)",
    )
    viz_defaults = {
        "num_slots": record.DEFAULT_NUM_SLOTS,
        "max_model_len": record.DEFAULT_MAX_MODEL_LEN,
        "num_requests": record.DEFAULT_NUM_REQUESTS,
        "max_steps": record.DEFAULT_MAX_STEPS,
    }
    parser.set_defaults(handler=run_viz, **viz_defaults)
    # The shared parents document simulate's defaults; say what viz uses instead.
    for action in parser._actions:
        if action.dest in viz_defaults and action.help:
            action.help = f"{action.help.split(' (default')[0]} (viz default: {viz_defaults[action.dest]})"
    return parser


def grid_from_args(args: argparse.Namespace) -> record.VizGrid:
    seeds = (
        record.parse_int_list(args.seeds, what="--seeds")
        if args.seeds is not None
        else tuple(range(args.seed, args.seed + SEEDS_PER_PAGE))
    )
    grid = record.VizGrid(
        allocators=record.parse_name_list(
            args.allocators, what="--allocators", allowed=record.KNOWN_ALLOCATORS
        ),
        block_sizes=record.parse_int_list(args.block_sizes, what="--block-sizes"),
        seeds=seeds,
        max_steps=args.max_steps,
    )
    too_big = [b for b in grid.block_sizes if b > args.num_slots]
    if too_big:
        raise InvalidArgumentError(f"--block-sizes {too_big} exceed the pool of {args.num_slots} slots")
    return grid


def build_data(args: argparse.Namespace) -> dict[str, Any]:
    """Record every run the arguments ask for; returns the page's data dict."""
    from pagedkv.sim.builders import build_config
    from pagedkv.sim.progress import Progress
    from pagedkv.viz.workload_source import workload_for_seed

    grid = grid_from_args(args)
    source = workload_for_seed(
        **cli_args.workload_kwargs(args), on_note=lambda note: print(f"viz: {note}", file=sys.stderr)
    )
    config = build_config(source(grid.seeds[0]), **cli_args.config_kwargs(args))
    with Progress(grid.num_runs, "viz: recording", enabled=not args.no_progress) as bar:
        data = record.record_grid(source, config, grid, on_run_done=lambda label: bar.update(1, label))
    data["initial"] = {
        "allocator": args.allocator if args.allocator in grid.allocators else grid.allocators[0],
        "block_size": args.block_size if args.block_size in grid.block_sizes else grid.block_sizes[0],
        "seed": args.seed if args.seed in grid.seeds else grid.seeds[0],
    }
    return data


def run_viz(args: argparse.Namespace) -> int:
    """``pagedkv viz`` for parsed ``args``; returns the exit status."""
    from pagedkv.commands.output import check_json_path, check_plot_path, write_json
    from pagedkv.viz.page import write_page
    from pagedkv.viz.serve import serve_page

    check_plot_path(args.plot)
    check_json_path(args.json)
    data = build_data(args)
    path = write_page(data, args.out, compress=not args.no_compress)
    size_kib = path.stat().st_size / 1024
    print(f"wrote {path} ({size_kib:,.0f} KiB, {len(data['runs'])} runs); open it in any browser")
    if args.json:
        write_json(
            args.json,
            {
                "num_slots": data["num_slots"],
                "max_model_len": data["max_model_len"],
                "workload": data["workload"],
                "runs": [
                    {
                        "allocator": r["allocator"],
                        "block_size": r["block_size"],
                        "seed": r["seed"],
                        "steps_recorded": r["n"],
                        **r["summary"],
                    }
                    for r in data["runs"]
                ],
            },
        )
        print(f"wrote {args.json}")
    if args.plot:
        from pagedkv.sim.plots import plot_viz_runs

        plot_viz_runs(data, args.plot)
        print(f"wrote {args.plot}")
    if args.serve:
        serve_page(path, port=args.port, duration_s=args.serve_seconds)
    return 0
