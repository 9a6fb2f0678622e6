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
    from pagedkv.sim import costmodel, cpu_calibration, plots, reports
    from pagedkv.sim.progress import Progress

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
    model = costmodel.CostModel(shape, hardware)
    contexts = args.contexts
    block_sizes = args.block_sizes
    table = model.table(contexts, block_sizes)
    print(
        _render_cost_table(
            table,
            title=(
                f"Model: {shape.name} ({shape.num_layers} layers, {shape.num_kv_heads} KV "
                f"heads x {shape.head_dim}, {shape.dtype}, "
                f"{shape.kv_bytes_per_token / 1024:.0f} KiB/token) on {hardware.name}: "
                f"{hardware.prefill_flops_per_s / 1e12:.0f} TFLOP/s prefill, "
                f"{hardware.host_link_bytes_per_s / 1e9:.0f} GB/s, "
                f"{hardware.per_transfer_latency_s * 1e6:.1f} us per copy"
            ),
        )
    )
    data: dict[str, Any] = {"model": table}
    cpu = None
    if not args.skip_cpu:
        cpu_contexts = [c for c in contexts if c <= args.cpu_max_context]
        with Progress(
            len(cpu_contexts) * (1 + len(block_sizes)), "measuring", enabled=progress_enabled(args)
        ) as bar:
            measurement = cpu_calibration.measure_cpu(
                cpu_contexts, block_sizes, on_step=lambda note: bar.update(1, note)
            )
        cpu = measurement.to_dict()
        data["cpu"] = cpu
        shape_cpu = measurement.shape
        print()
        print(
            _render_cost_table(
                cpu,
                title=(
                    f"Measured on this CPU: {shape_cpu.name} NumPy prefill ({shape_cpu.num_layers} layer, hidden "
                    f"{shape_cpu.hidden_size}, {shape_cpu.num_q_heads}/{shape_cpu.num_kv_heads} heads x {shape_cpu.head_dim}, "
                    f"fp32) vs one NumPy copy per block per layer per K/V"
                ),
            )
        )
        fitted = measurement.fitted
        print()
        print(
            reports.format_table(
                ["fitted CPU parameter", "value"],
                [
                    ["matmul rate (GFLOP/s)", fitted["linear_flops_per_s"] / 1e9],
                    ["attention rate (GFLOP/s)", fitted["attention_flops_per_s"] / 1e9],
                    ["copy bandwidth (GB/s)", fitted["copy_bytes_per_s"] / 1e9],
                    ["per-copy latency (us)", fitted["per_copy_latency_s"] * 1e6],
                    ["recompute fit, worst error", reports.percent(fitted["recompute_max_rel_error"])],
                    ["swap fit, worst error", reports.percent(fitted["swap_max_rel_error"])],
                ],
            )
        )
    return finish(args, data, lambda path: plots.plot_costmodel(table, cpu, path))


def _render_cost_table(table: dict, *, title: str) -> str:
    from pagedkv.sim import reports

    contexts = table["contexts_tokens"]
    headers = ["seconds", *(f"{c:,}" for c in contexts)]
    rows = [["recompute", *(f"{s:.3g}" for s in table["recompute_s"])]]
    for block_size, row in zip(table["block_sizes"], table["swap_s"]):
        rows.append(
            [
                f"swap, block {block_size}",
                *(f"{s:.3g}" + ("*" if s < r else "") for s, r in zip(row, table["recompute_s"])),
            ]
        )
    crossovers = ", ".join(
        f"block {b}: {('>' + format(max(contexts), ',')) if c is None else format(c, ',')}"
        for b, c in zip(table["block_sizes"], table["crossover_context_tokens"])
    )
    return reports.format_table(
        headers, rows, title=title, note=f"* swap cheaper. Swap wins from context (tokens): {crossovers}"
    )


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
        help="longest context measured on the CPU (default 16384)",
    )
    cost.set_defaults(handler=_cmd_costmodel)
