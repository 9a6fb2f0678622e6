"""``pagedkv costmodel``: recompute or swap? The cost model for an accelerator, and a measurement
on this CPU with the model's parameters fitted to it."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from pagedkv.commands import args as cli_args
from pagedkv.commands.output import check_outputs, finish, progress_enabled

__all__ = ["register"]


def _cmd_costmodel(args: argparse.Namespace) -> int:
    from pagedkv.sim import costmodel, plots
    from pagedkv.sim.experiments.recompute_or_swap import recompute_or_swap, render_recompute_or_swap

    check_outputs(args)
    shape = dataclasses.replace(
        costmodel.LLAMA3_8B,
        **{
            key: value
            for key, value in (
                ("num_layers", args.num_layers),
                ("num_kv_heads", args.num_kv_heads),
                ("head_dim", args.head_dim),
                ("dtype", args.dtype),
            )
            if value is not None
        },
    )
    if args.num_kv_heads is not None and shape.num_q_heads % shape.num_kv_heads:
        shape = dataclasses.replace(
            shape, num_q_heads=shape.num_kv_heads * max(1, shape.num_q_heads // shape.num_kv_heads)
        )
    default = costmodel.H200_PCIE5
    customized = (args.flops, args.bandwidth, args.latency) != (None, None, None)
    hardware = costmodel.Hardware(
        f"{default.name}, customized" if customized else default.name,
        prefill_flops_per_s=args.flops or default.prefill_flops_per_s,
        host_link_bytes_per_s=args.bandwidth or default.host_link_bytes_per_s,
        per_transfer_latency_s=default.per_transfer_latency_s if args.latency is None else args.latency,
    )
    data = recompute_or_swap(
        costmodel.CostModel(shape, hardware),
        args.contexts,
        args.block_sizes,
        measure_cpu=not args.skip_cpu,
        cpu_max_context_tokens=args.cpu_max_context,
        progress=progress_enabled(args),
    )
    print(render_recompute_or_swap(data))
    return finish(args, data, lambda path: plots.plot_costmodel(data["model"], data.get("cpu"), path))


def register(subparsers: Any) -> None:
    """Add ``costmodel`` to the ``pagedkv`` subparsers."""
    cost = subparsers.add_parser(
        "costmodel",
        parents=[cli_args.output_options()],
        help="recompute vs swap cost: the model (H200/PCIe 5) and a CPU measurement",
    )
    cost.add_argument(
        "--contexts",
        type=cli_args.positive_int_list,
        default=[128, 256, 512, 1024, 2048, 4096, 8192, 16384],
        help="comma-separated context lengths in tokens",
    )
    cost.add_argument(
        "--block-sizes", type=cli_args.positive_int_list, default=[1, 2, 4, 8, 16, 32, 64, 128, 256]
    )
    cost.add_argument(
        "--num-layers", type=cli_args.positive_int, default=None, help="model shape (default Llama-3-8B)"
    )
    cost.add_argument("--num-kv-heads", type=cli_args.positive_int, default=None)
    cost.add_argument("--head-dim", type=cli_args.positive_int, default=None)
    cost.add_argument("--dtype", choices=("float32", "float16", "bfloat16", "float8"), default=None)
    cost.add_argument(
        "--flops", type=cli_args.positive_float, default=None, help="prefill FLOP/s (default 494.5e12)"
    )
    cost.add_argument(
        "--bandwidth", type=cli_args.positive_float, default=None, help="host link bytes/s (default 50e9)"
    )
    cost.add_argument(
        "--latency", type=cli_args.non_negative_float, default=None, help="seconds per copy (default 5e-6)"
    )
    cost.add_argument("--skip-cpu", action="store_true", help="model only, no CPU measurement")
    cost.add_argument(
        "--cpu-max-context",
        type=cli_args.positive_int,
        default=16384,
        help="longest context measured on the CPU (default 16384; at least one of --contexts)",
    )
    cost.set_defaults(handler=_cmd_costmodel)
