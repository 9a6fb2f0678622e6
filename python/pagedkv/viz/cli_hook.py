"""``pagedkv viz``: the command-line entry of the visualizer.

``pagedkv.cli`` wires it with two lines::

    add_viz_parser(subparsers)                 # in build_parser()
    if args.command == "viz": return run_viz(args)   # in main()
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pagedkv.errors import InvalidArgumentError
from pagedkv.viz import record

DEFAULT_OUT = "pagedkv-viz.html"


def add_viz_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``viz`` sub-command to an ``argparse`` sub-parsers object; returns its parser."""
    parser = subparsers.add_parser(
        "viz",
        help="write an interactive HTML page showing the block pool step by step",
        description=(
            "Record the simulator on one workload for every allocator x block size x seed, on "
            "the same pool, and write one self-contained HTML page (no network needed) to step "
            "through them: the pool grid, each request's block table, waste and counters."
        ),
    )
    parser.add_argument("--workload", default="synthetic",
                        help="generator name (synthetic, sharegpt, lognormal, alpaca, system-prompt), "
                             "a known trace (azure-conv, azure-code) or PATH.csv (default: synthetic)")
    parser.add_argument("--num-requests", type=int, default=record.DEFAULT_NUM_REQUESTS,
                        help="requests per workload seed (default: %(default)s)")
    parser.add_argument("--num-slots", type=int, default=record.DEFAULT_NUM_SLOTS,
                        help="pool size in token slots, the same for every allocator (default: %(default)s)")
    parser.add_argument("--max-model-len", type=int, default=record.DEFAULT_MAX_MODEL_LEN,
                        help="longest request in tokens; contiguous-max reserves this much (default: %(default)s)")
    parser.add_argument("--arrival", default="saturated",
                        help="saturated | trace | poisson:RATE (requests/s) (default: %(default)s)")
    parser.add_argument("--allocators", default=",".join(record.DEFAULT_ALLOCATORS),
                        help="comma-separated allocators to record (default: %(default)s)")
    parser.add_argument("--block-sizes", default=",".join(map(str, record.DEFAULT_BLOCK_SIZES)),
                        help="comma-separated block sizes in tokens (default: %(default)s)")
    parser.add_argument("--seeds", default=",".join(map(str, record.DEFAULT_SEEDS)),
                        help="comma-separated workload seeds (default: %(default)s)")
    parser.add_argument("--max-steps", type=int, default=record.DEFAULT_MAX_STEPS,
                        help="engine steps recorded per run (default: %(default)s)")
    parser.add_argument("--out", default=DEFAULT_OUT, help="HTML file to write (default: %(default)s)")
    parser.add_argument("--serve", action="store_true",
                        help="also serve the page on http://127.0.0.1 and print the URL")
    parser.add_argument("--port", type=int, default=0, help="port for --serve (default: any free port)")
    parser.add_argument("--serve-seconds", type=float, default=None,
                        help="stop serving after this many seconds (default: until Ctrl-C)")
    return parser


def _arrival(text: str) -> dict[str, Any]:
    """``saturated`` | ``trace`` | ``poisson:RATE`` -> SimConfig fields."""
    if text in ("saturated", "trace"):
        return {"arrival": text}
    kind, _, rate = text.partition(":")
    if kind == "poisson":
        try:
            rate_per_s = float(rate)
        except ValueError:
            rate_per_s = -1.0
        if rate_per_s > 0:
            return {"arrival": "poisson", "poisson_rate": rate_per_s}
    raise InvalidArgumentError(f"--arrival: expected saturated, trace or poisson:RATE with RATE > 0, got {text!r}")


def build_data(args: argparse.Namespace, *, log: Any = None) -> dict[str, Any]:
    """Record every run the arguments ask for; returns the page's data dict."""
    from pagedkv.sim.engine import SimConfig
    from pagedkv.viz.workload_source import workload_source

    grid = record.VizGrid(
        allocators=record.parse_name_list(args.allocators, what="--allocators",
                                          allowed=record.KNOWN_ALLOCATORS),
        block_sizes=record.parse_int_list(args.block_sizes, what="--block-sizes"),
        seeds=record.parse_int_list(args.seeds, what="--seeds"),
        max_steps=args.max_steps,
    )
    for name, value in (("--num-slots", args.num_slots), ("--max-model-len", args.max_model_len)):
        if value < 1:
            raise InvalidArgumentError(f"{name} must be >= 1, got {value}")
    too_big = [b for b in grid.block_sizes if b > args.num_slots]
    if too_big:
        raise InvalidArgumentError(f"--block-sizes {too_big} exceed the pool of {args.num_slots} slots")
    notes = log if log is not None else (lambda message: print(message, file=sys.stderr))
    source = workload_source(args.workload, num_requests=args.num_requests,
                             max_model_len=args.max_model_len, on_note=notes)
    config = SimConfig(num_slots=args.num_slots, max_model_len=args.max_model_len, **_arrival(args.arrival))
    from pagedkv.sim.progress import Progress

    with Progress(grid.num_runs, "viz: recording runs") as bar:
        data = record.record_grid(source, config, grid, on_run_done=lambda label: bar.update(1, label))
    return data


def run_viz(args: argparse.Namespace) -> int:
    """Run ``pagedkv viz`` for parsed ``args``; returns the process exit status."""
    from pagedkv.viz.page import write_page
    from pagedkv.viz.serve import serve_page

    data = build_data(args)
    path = write_page(data, args.out)
    size_kib = path.stat().st_size / 1024
    print(f"wrote {path} ({size_kib:,.0f} KiB, {len(data['runs'])} runs); open it in any browser")
    if args.serve:
        serve_page(path, port=args.port, duration_s=args.serve_seconds)
    return 0
