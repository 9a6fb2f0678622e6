"""``pagedkv simulate``, ``sweep``, ``compare`` and ``recovery``: one workload, replayed.

Each parses its flags, builds the workload and the config with `pagedkv.sim.builders`, runs one
experiment of `pagedkv.sim.experiments` and prints its tables. A flag a command sets itself
(``compare`` runs every allocator, ``sweep`` every block size, ``recovery`` both preemption
policies) is not offered there, so argparse refuses it instead of ignoring it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any

from pagedkv.commands import args as cli_args
from pagedkv.commands.output import check_outputs, finish, progress_enabled

__all__ = ["register", "build_workload_and_config"]


def build_workload_and_config(args: argparse.Namespace) -> tuple[Any, Any]:
    """The workload and the `SimConfig` of a command's workload and engine options."""
    from pagedkv.sim import builders

    workload = builders.build_workload(
        **cli_args.workload_kwargs(args), on_note=lambda note: print(note, file=sys.stderr)
    )
    return workload, builders.build_config(workload, **cli_args.config_kwargs(args))


def _cmd_simulate(args: argparse.Namespace) -> int:
    from pagedkv.sim import experiments, plots, reports, workloads
    from pagedkv.sim.names import allocator_label

    check_outputs(args)
    workload, config = build_workload_and_config(args)
    start_s = time.perf_counter()
    result = experiments.run_simulation(workload, config, progress=progress_enabled(args))
    wall_s = time.perf_counter() - start_s
    summary = experiments.summarize(result)
    label = allocator_label(config.allocator)
    layout = (
        f"block size {config.block_size}" if config.allocator == "paged" else f"placement {config.placement}"
    )
    if config.scheduling != "fcfs":
        layout += f", scheduling {config.scheduling} (aging bound {config.aging_bound})"
    print(
        reports.shares_table(
            {label: summary},
            title=f"{workload.name}: pool {config.num_slots:,} slots, {layout}, "
            f"max_model_len {config.max_model_len}, arrival {config.arrival}",
        )
    )
    print()
    print(reports.occupancy_table({label: summary}))
    extras: list[list[Any]] = [
        [label_text, summary[key]]
        for label_text, key in (
            ("generated tokens", "generated_tokens"),
            ("simulated seconds", "simulated_seconds"),
            ("prefill tokens", "prefill_tokens"),
            ("recomputed tokens", "recomputed_tokens"),
            ("prefix hit tokens", "prefix_hit_tokens"),
            ("prefix query tokens", "prefix_query_tokens"),
            ("prompt tokens (first admissions)", "prompt_tokens"),
            ("prompt tokens served from cache", "prompt_hit_tokens"),
            ("token hit rate", "token_hit_rate"),
            ("optimal token hit rate", "optimal_token_hit_rate"),
            ("hit rate / optimum", "hit_rate_of_optimum"),
            ("mean wait (s)", "mean_wait_s"),
            ("p99 wait (s)", "p99_wait_s"),
            ("blocks swapped out", "swapped_out_blocks"),
            ("blocks swapped in", "swapped_in_blocks"),
            ("swapped blocks", "swapped_blocks"),
            ("mean waste per request (tokens)", "mean_waste_per_request_tokens"),
            ("mean block-table length", "mean_block_table_len"),
        )
        if key in summary
    ]
    if config.scheduling != "fcfs":
        extras += [
            [f"scheduling {config.scheduling}: aging bound (admissions)", summary["aging_bound"]],
            ["most admissions passing over one request", summary["max_passed_over"]],
            ["admissions forced by the aging bound", summary["forced_admissions"]],
            ["blocks evicted while a waiting request needed them", summary["evicted_wanted_blocks"]],
        ]
    extras.append(
        ["simulated tokens per wall second", summary["generated_tokens"] / wall_s if wall_s > 0 else 0.0]
    )
    print()
    # One row per metric, each in its own format: counts as integers, the rest with decimals.
    rows = [
        [name, reports.Number(value, "," if isinstance(value, int) else ",.2f")] for name, value in extras
    ]
    print(reports.format_table(["metric", "value"], rows))
    data = {
        **result.to_dict(),
        "mean_waste_per_request_tokens": summary["mean_waste_per_request_tokens"],
        "mean_block_table_len": summary["mean_block_table_len"],
        "waste": summary["waste"],
        "wall_s": wall_s,
        "workload": workloads.describe(workload),
        "config": dataclasses.asdict(config),
    }
    return finish(
        args,
        data,
        lambda path: plots.plot_simulation(result, path, title=f"{workload.name}, {label}, {layout}"),
    )


def _cmd_sweep(args: argparse.Namespace) -> int:
    from pagedkv.sim import experiments, plots

    check_outputs(args)
    workload, config = build_workload_and_config(args)
    data = experiments.block_size_sweep(
        workload, config, block_sizes=args.block_sizes, progress=progress_enabled(args)
    )
    print(experiments.render_sweep(data))
    return finish(
        args, data, lambda path: plots.plot_sweep(data, path, title=f"Block-size sweep: {workload.name}")
    )


def _cmd_compare(args: argparse.Namespace) -> int:
    from pagedkv.sim import experiments, plots

    check_outputs(args)
    workload, config = build_workload_and_config(args)
    data = experiments.compare_allocators(workload, config, progress=progress_enabled(args))
    print(experiments.render_compare(data))
    return finish(
        args,
        data,
        lambda path: plots.plot_shares(
            data["results"], path, title=f"Waste breakdown, same memory: {workload.name}"
        ),
    )


def _cmd_recovery(args: argparse.Namespace) -> int:
    from pagedkv.sim import experiments, plots

    check_outputs(args)
    workload, config = build_workload_and_config(args)
    data = experiments.recovery(workload, config, progress=progress_enabled(args))
    print(experiments.render_recovery(data))
    return finish(
        args,
        data,
        lambda path: plots.plot_recovery(data, path, title=f"Exhaustion and recovery: {workload.name}"),
    )


def register(subparsers: Any) -> None:
    """Add ``simulate``, ``sweep``, ``compare`` and ``recovery`` to the ``pagedkv`` subparsers."""
    workload, output = cli_args.workload_options, cli_args.output_options

    simulate = subparsers.add_parser(
        "simulate",
        parents=[workload(), cli_args.engine_options(), output()],
        help="replay a workload under one allocator",
    )
    simulate.set_defaults(handler=_cmd_simulate)

    sweep = subparsers.add_parser(
        "sweep",
        parents=[workload(), cli_args.engine_options(allocator=False, block_size=False), output()],
        help="paged block size 1...256: utilization, waste vs block-table length",
        description="The paged allocator at each of --block-sizes on the same pool.",
    )
    sweep.add_argument(
        "--block-sizes",
        type=cli_args.positive_int_list,
        default=[1, 2, 4, 8, 16, 32, 64, 128, 256],
        help="comma-separated block sizes (default 1,2,4,...,256)",
    )
    sweep.set_defaults(handler=_cmd_sweep)

    compare = subparsers.add_parser(
        "compare",
        parents=[workload(), cli_args.engine_options(allocator=False), output()],
        help="waste breakdown of all allocators side by side",
        description="Every allocator on the same workload and pool (--block-size applies to the paged "
        "one, --placement to the contiguous ones).",
    )
    compare.set_defaults(handler=_cmd_compare)

    recovery = subparsers.add_parser(
        "recovery",
        parents=[workload(), cli_args.engine_options(allocator=False, preemption=False), output()],
        help="exhaustion and recovery: recompute vs swap on one workload",
        description="The paged allocator runs out of blocks and recovers, once by recompute and once "
        "by swap (to --num-host-slots, default as many as --num-slots).",
    )
    recovery.set_defaults(handler=_cmd_recovery)
