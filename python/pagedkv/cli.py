"""The pagedkv command line: the demo, the simulator and the experiments.

'pagedkv demo' (no arguments) is the main job: the whole PagedAttention story in under a minute.
Every command prints tables; '--json FILE' writes its numbers and '--plot FILE' a PNG.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import pagedkv
from pagedkv.errors import PagedKvError

ALLOCATOR_CHOICES = ("paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle")
SYNTHETIC_WORKLOADS = ("synthetic", "sharegpt", "lognormal", "system-prompt", "alpaca")
TRACE_WORKLOADS = ("azure-conv", "azure-code")
# The Azure traces are CC-BY 4.0: results computed from them carry this attribution.
AZURE_ATTRIBUTION = "Data: Azure LLM inference trace 2023, Azure Public Dataset, Microsoft (CC-BY 4.0)"


class CliError(PagedKvError):
    """A bad combination of command-line options (the message says which)."""


def _parse_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _positive_int(text: str) -> int:
    value = _parse_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


# Requests of one synthetic workload: a bound far above any useful run, so that a typo cannot ask
# NumPy for arrays beyond memory (which fails with a traceback, not a clear message).
MAX_NUM_REQUESTS = 10_000_000


def _num_requests(text: str) -> int:
    value = _positive_int(text)
    if value > MAX_NUM_REQUESTS:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_NUM_REQUESTS:,} requests, got {value}")
    return value


def _seed(text: str) -> int:
    value = _parse_int(text)
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**64), got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def _arrival(text: str) -> tuple[str, float | None]:
    """``saturated`` | ``trace`` | ``poisson`` | ``poisson:RATE`` (requests per second)."""
    mode, sep, rate = text.partition(":")
    if mode in ("saturated", "trace") and not rate:
        return mode, None
    if mode == "poisson":
        if sep and not rate:
            raise argparse.ArgumentTypeError("expected poisson:RATE with a rate, got 'poisson:'")
        return mode, _positive_float(rate) if rate else None
    raise argparse.ArgumentTypeError(f"expected saturated, trace or poisson:RATE, got {text!r}")


def _workload_options() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("workload")
    group.add_argument(
        "--workload",
        default="synthetic",
        metavar="NAME|PATH.csv",
        help=f"{'|'.join(SYNTHETIC_WORKLOADS + TRACE_WORKLOADS)} or the path of a CSV trace "
        "(TIMESTAMP,ContextTokens,GeneratedTokens) (default: synthetic)",
    )
    group.add_argument(
        "--num-requests",
        type=_num_requests,
        default=None,
        help="requests of a synthetic workload (default 1000), or the first N of a trace",
    )
    group.add_argument(
        "--seed", type=_seed, default=0, help="seed of the workload and the simulation (default 0)"
    )
    group.add_argument(
        "--prompt-mean", type=_positive_float, default=None, help="lognormal: mean prompt tokens"
    )
    group.add_argument(
        "--output-mean", type=_positive_float, default=None, help="lognormal: mean output tokens"
    )
    group.add_argument(
        "--prompt-sigma", type=float, default=1.0, help="lognormal: spread of log prompt length"
    )
    group.add_argument(
        "--output-sigma", type=float, default=1.0, help="lognormal: spread of log output length"
    )
    group.add_argument(
        "--parallel-samples",
        type=_positive_int,
        default=None,
        metavar="N",
        help="each request samples N outputs sharing its prompt (parallel sampling)",
    )
    group.add_argument(
        "--beam-width",
        type=_positive_int,
        default=None,
        metavar="W",
        help="each request runs beam search of width W",
    )
    return parent


def _engine_options() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("engine and memory")
    group.add_argument("--allocator", choices=ALLOCATOR_CHOICES, default="paged")
    group.add_argument(
        "--placement",
        choices=("first-fit", "buddy"),
        default="first-fit",
        help="address-space allocator of the contiguous policies (default first-fit)",
    )
    group.add_argument("--block-size", type=_positive_int, default=16, help="tokens per block (default 16)")
    group.add_argument(
        "--num-slots",
        type=_positive_int,
        default=15_744,
        help="KV pool size in token slots (default 15744: a 13B model on a 40 GB GPU)",
    )
    group.add_argument(
        "--max-model-len",
        type=_positive_int,
        default=None,
        help="longest request in tokens (default 2048; a trace's longest request for traces)",
    )
    group.add_argument(
        "--arrival",
        type=_arrival,
        default=("saturated", None),
        metavar="MODE",
        help="saturated (all at once) | trace (the workload's own times) | poisson:RATE",
    )
    group.add_argument("--step-time", type=_positive_float, default=0.02, help="seconds per engine step")
    group.add_argument("--preemption", choices=("recompute", "swap"), default="recompute")
    group.add_argument(
        "--num-host-slots",
        type=int,
        default=None,
        help="host-tier token slots for swap (default: as many as --num-slots with "
        "--preemption swap, else 0)",
    )
    group.add_argument("--max-num-seqs", type=_positive_int, default=256, help="batch cap (default 256)")
    group.add_argument("--prefix-caching", action="store_true", help="enable prefix caching (paged)")
    group.add_argument("--max-steps", type=_positive_int, default=None, help="stop after this many steps")
    return parent


def _output_options() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("output")
    group.add_argument("--json", metavar="FILE", default=None, help="write the numbers as one JSON object")
    group.add_argument("--plot", metavar="FILE", default=None, help="write a PNG plot (needs matplotlib)")
    group.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return parent


def build_workload(args: argparse.Namespace) -> Any:
    """The workload named by ``--workload`` (a synthetic name, a known trace or a CSV path)."""
    from pagedkv.sim import traces, workloads

    name = args.workload
    max_model_len = args.max_model_len or 2048
    if name in SYNTHETIC_WORKLOADS:
        rate = args.arrival[1] or workloads.DEFAULT_ARRIVAL_RATE_PER_S
        workload = workloads.make_workload(
            name,
            num_requests=args.num_requests,
            seed=args.seed,
            max_model_len=max_model_len,
            arrival_rate_per_s=rate,
            prompt_mean_tokens=args.prompt_mean,
            output_mean_tokens=args.output_mean,
            prompt_sigma=args.prompt_sigma,
            output_sigma=args.output_sigma,
        )
    else:
        path = traces.known_trace_path(name) if name in TRACE_WORKLOADS else name
        if name not in TRACE_WORKLOADS and not str(name).lower().endswith(".csv"):
            raise CliError(
                f"--workload {name!r}: expected one of {', '.join(SYNTHETIC_WORKLOADS + TRACE_WORKLOADS)} "
                "or a path ending in .csv"
            )
        workload = traces.read_azure_csv(path)
        if os.path.basename(str(path)).startswith("azure_llm_"):
            print(AZURE_ATTRIBUTION, file=sys.stderr)
        if args.num_requests is not None:
            workload = dataclasses.replace(
                workload,
                prompt_tokens=workload.prompt_tokens[: args.num_requests],
                output_tokens=workload.output_tokens[: args.num_requests],
                arrival_s=workload.arrival_s[: args.num_requests],
            )
    if args.parallel_samples and args.beam_width:
        raise CliError("--parallel-samples and --beam-width exclude each other")
    if args.parallel_samples:
        workload = workloads.with_groups(workload, args.parallel_samples, "parallel")
    if args.beam_width:
        workload = workloads.with_groups(workload, args.beam_width, "beam")
    return workload


def build_config(args: argparse.Namespace, workload: Any) -> Any:
    """The `SimConfig` of the engine options; a trace's default max_model_len is its longest request."""
    from pagedkv.sim.engine import SimConfig

    max_model_len = args.max_model_len
    if max_model_len is None:
        longest = int((workload.prompt_tokens + workload.output_tokens).max())
        max_model_len = max(2048, longest) if args.workload not in SYNTHETIC_WORKLOADS else 2048
    host_slots = args.num_host_slots
    if host_slots is None:
        host_slots = args.num_slots if args.preemption == "swap" else 0
    if host_slots < 0:
        raise CliError(f"--num-host-slots must be >= 0, got {host_slots}")
    mode, rate = args.arrival
    extra = {"poisson_rate": rate} if rate is not None else {}
    return SimConfig(
        allocator=args.allocator,
        placement=args.placement,
        block_size=args.block_size,
        num_slots=args.num_slots,
        max_model_len=max_model_len,
        arrival=mode,
        step_time_s=args.step_time,
        preemption=args.preemption,
        num_host_slots=host_slots,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=args.prefix_caching,
        seed=args.seed,
        max_steps=args.max_steps,
        **extra,
    )


def _json_default(value: Any) -> Any:
    import numpy as np

    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


def write_json(path: str, data: Any) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise CliError(f"--json {path!r}: folder {directory!r} does not exist")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2, default=_json_default)
        handle.write("\n")


def _check_plot_path(path: str | None) -> None:
    """Fail before the (possibly long) run when the plot could not be written afterwards."""
    if path is None:
        return
    if not path.lower().endswith(".png"):
        raise CliError(f"--plot {path!r}: the plot is a PNG, give a file name ending in .png")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise CliError(f"--plot {path!r}: folder {directory!r} does not exist")
    if importlib.util.find_spec("matplotlib") is None:
        raise CliError("--plot needs matplotlib: pip install 'pagedkv[plot]'")


def _finish(args: argparse.Namespace, data: Any, plot: Callable[[str], None] | None) -> int:
    if args.json:
        write_json(args.json, data)
        print(f"\nwrote {args.json}")
    if args.plot and plot is not None:
        plot(args.plot)
        print(f"wrote {args.plot}")
    return 0


def _progress(args: argparse.Namespace) -> bool:
    return not getattr(args, "no_progress", False)


# ---------------------------------------------------------------- commands


def _cmd_demo(args: argparse.Namespace) -> int:
    from pagedkv.sim import experiments, plots

    _check_plot_path(args.plot)
    print(f"pagedkv {pagedkv.__version__} demo: why paging the KV cache wins, measured")
    data = experiments.demo(
        progress=_progress(args),
        num_requests=args.num_requests,
        seed=args.seed,
        attention_backend=args.attention_backend,
    )
    return _finish(args, data, lambda path: plots.plot_demo(data, path))


def _cmd_simulate(args: argparse.Namespace) -> int:
    from pagedkv.sim import experiments, plots, reports, workloads

    _check_plot_path(args.plot)
    workload = build_workload(args)
    config = build_config(args, workload)
    start_s = time.perf_counter()
    result = experiments.run_simulation(workload, config, progress=_progress(args))
    wall_s = time.perf_counter() - start_s
    summary = experiments.summarize(result)
    label = f"{config.allocator}" + (
        f" ({config.placement})" if config.allocator != "paged" else f" (block {config.block_size})"
    )
    print(
        reports.shares_table(
            {label: summary},
            title=f"{workload.name}: pool {config.num_slots:,} slots, "
            f"max_model_len {config.max_model_len}, arrival {config.arrival}",
        )
    )
    print()
    print(reports.occupancy_table({label: summary}))
    extras = [
        [label_text, summary[key]]
        for label_text, key in (
            ("generated tokens", "generated_tokens"),
            ("simulated seconds", "simulated_seconds"),
            ("prefill tokens", "prefill_tokens"),
            ("recomputed tokens", "recomputed_tokens"),
            ("prefix hit tokens", "prefix_hit_tokens"),
            ("prefix query tokens", "prefix_query_tokens"),
            ("blocks swapped out", "swapped_out_blocks"),
            ("blocks swapped in", "swapped_in_blocks"),
            ("swapped blocks", "swapped_blocks"),
            ("mean waste per request (tokens)", "mean_waste_per_request_tokens"),
            ("mean block-table length", "mean_block_table_len"),
        )
        if key in summary
    ]
    extras.append(
        ["simulated tokens per wall second", summary["generated_tokens"] / wall_s if wall_s > 0 else 0.0]
    )
    print()
    print(reports.format_table(["metric", "value"], extras))
    data = {
        **result.to_dict(),
        "mean_waste_per_request_tokens": summary["mean_waste_per_request_tokens"],
        "mean_block_table_len": summary["mean_block_table_len"],
        "wall_s": wall_s,
        "workload": workloads.describe(workload),
        "config": dataclasses.asdict(config),
    }
    return _finish(
        args, data, lambda path: plots.plot_simulation(result, path, title=f"{workload.name}, {label}")
    )


def _cmd_sweep(args: argparse.Namespace) -> int:
    from pagedkv.sim import experiments, plots

    _check_plot_path(args.plot)
    workload = build_workload(args)
    config = build_config(args, workload)
    data = experiments.block_size_sweep(
        workload, config, block_sizes=args.block_sizes, progress=_progress(args)
    )
    print(experiments.render_sweep(data))
    return _finish(
        args, data, lambda path: plots.plot_sweep(data, path, title=f"Block-size sweep: {workload.name}")
    )


def _cmd_compare(args: argparse.Namespace) -> int:
    from pagedkv.sim import experiments, plots

    _check_plot_path(args.plot)
    workload = build_workload(args)
    config = build_config(args, workload)
    data = experiments.compare_allocators(workload, config, progress=_progress(args))
    print(experiments.render_compare(data))
    return _finish(
        args,
        data,
        lambda path: plots.plot_shares(
            data["results"], path, title=f"Waste breakdown, same memory: {workload.name}"
        ),
    )


def _cmd_figure2(args: argparse.Namespace) -> int:
    from pagedkv.sim import experiments, plots

    _check_plot_path(args.plot)
    placements = ("buddy", "first-fit") if args.placement == "both" else (args.placement,)
    data = experiments.figure2(
        num_requests=args.num_requests, seed=args.seed, placements=placements, progress=_progress(args)
    )
    print(experiments.render_figure2(data))
    return _finish(
        args,
        data,
        lambda path: plots.plot_shares(
            data["results"],
            path,
            title="vLLM Figure 2 setting (dashes: published token states)",
            published_token_states=data["published_token_states"],
        ),
    )


def _cmd_sharing(args: argparse.Namespace) -> int:
    from pagedkv.sim import experiments, plots

    _check_plot_path(args.plot)
    data = experiments.sharing_savings(
        num_requests=args.num_requests, block_size=args.block_size, seed=args.seed, progress=_progress(args)
    )
    print(experiments.render_sharing(data))
    return _finish(args, data, lambda path: plots.plot_sharing(data["rows"], path, title="Sharing savings"))


def _cmd_recovery(args: argparse.Namespace) -> int:
    from pagedkv.sim import experiments

    workload = build_workload(args)
    config = build_config(args, workload)
    data = experiments.recovery(workload, config, progress=_progress(args))
    print(experiments.render_recovery(data))
    return _finish(args, data, None)


def _cmd_costmodel(args: argparse.Namespace) -> int:
    from pagedkv.sim import costmodel, plots, reports
    from pagedkv.sim.progress import Progress

    _check_plot_path(args.plot)
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
            len(cpu_contexts) * (1 + len(block_sizes)), "measuring", enabled=_progress(args)
        ) as bar:
            measurement = costmodel.measure_cpu(
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
    return _finish(args, data, lambda path: plots.plot_costmodel(table, cpu, path))


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


# ---------------------------------------------------------------- parser


def add_viz_command(subparsers: Any) -> None:
    """Hook for the visualizer: registers ``pagedkv viz`` when ``pagedkv.viz.cli`` exists.

    That module provides ``add_parser(subparsers, parents) -> argparse.ArgumentParser``; it
    receives the workload, engine and output option parents (so ``viz`` takes the same workload
    options as ``simulate``) and sets ``handler=`` to a function ``(args) -> exit code``. The
    parents are built afresh for it: argparse shares parent actions by reference, so viz's own
    defaults (``set_defaults``) would otherwise leak into every other command.
    """
    if importlib.util.find_spec("pagedkv.viz") is None or importlib.util.find_spec("pagedkv.viz.cli") is None:
        return
    from pagedkv.viz import cli as viz_cli

    viz_cli.add_parser(subparsers, [_workload_options(), _engine_options(), _output_options()])


def _positive_int_list(text: str) -> list[int]:
    """Comma-separated integers >= 1 (block sizes, context lengths)."""
    return [_positive_int(part) for part in text.split(",") if part]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedkv", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"pagedkv {pagedkv.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    workload, engine, output = _workload_options(), _engine_options(), _output_options()

    demo = subparsers.add_parser(
        "demo",
        parents=[output],
        help="the main job: the whole story in under a minute",
        description="Paged vs contiguous attention, allocators, block sizes, copy-on-write, "
        "exhaustion and recovery, prefix caching: six printed sections.",
    )
    demo.add_argument(
        "--num-requests", type=_positive_int, default=1000, help="synthetic requests (default 1000)"
    )
    demo.add_argument("--seed", type=_seed, default=0)
    demo.add_argument(
        "--attention-backend",
        choices=("numpy", "emulated", "cuda"),
        default="numpy",
        help="backend of section (a) (default numpy; emulated compiles the CUDA source for the CPU)",
    )
    demo.set_defaults(handler=_cmd_demo)

    simulate = subparsers.add_parser(
        "simulate", parents=[workload, engine, output], help="replay a workload under one allocator"
    )
    simulate.set_defaults(handler=_cmd_simulate)

    sweep = subparsers.add_parser(
        "sweep",
        parents=[workload, engine, output],
        help="paged block size 1...256: utilization, waste vs block-table length",
    )
    sweep.add_argument(
        "--block-sizes",
        type=_positive_int_list,
        default=[1, 2, 4, 8, 16, 32, 64, 128, 256],
        help="comma-separated block sizes (default 1,2,4,...,256)",
    )
    sweep.set_defaults(handler=_cmd_sweep)

    compare = subparsers.add_parser(
        "compare", parents=[workload, engine, output], help="waste breakdown of all allocators side by side"
    )
    compare.set_defaults(handler=_cmd_compare)

    figure2 = subparsers.add_parser(
        "figure2",
        parents=[output],
        help="the vLLM paper's Figure 2 setting, our shares beside the published ones",
    )
    figure2.add_argument("--num-requests", type=_positive_int, default=2000)
    figure2.add_argument("--seed", type=_seed, default=0)
    figure2.add_argument(
        "--placement",
        choices=("both", "buddy", "first-fit"),
        default="both",
        help="placement of the contiguous policies (default both; buddy, as Orca, first)",
    )
    figure2.set_defaults(handler=_cmd_figure2)

    sharing = subparsers.add_parser(
        "sharing",
        parents=[output],
        help="blocks saved by sharing: parallel sampling and beam search, width 2/4/6",
    )
    sharing.add_argument(
        "--num-requests", type=_positive_int, default=100, help="groups per row (default 100)"
    )
    sharing.add_argument("--block-size", type=_positive_int, default=16)
    sharing.add_argument("--seed", type=_seed, default=0)
    sharing.set_defaults(handler=_cmd_sharing)

    recovery = subparsers.add_parser(
        "recovery",
        parents=[workload, engine, output],
        help="exhaustion and recovery: recompute vs swap on one workload",
    )
    recovery.set_defaults(handler=_cmd_recovery)

    cost = subparsers.add_parser(
        "costmodel",
        parents=[output],
        help="recompute vs swap cost: the model (H200/PCIe 5) and a CPU measurement",
    )
    cost.add_argument(
        "--contexts",
        type=_positive_int_list,
        default=[128, 256, 512, 1024, 2048, 4096, 8192, 16384],
        help="comma-separated context lengths in tokens",
    )
    cost.add_argument("--block-sizes", type=_positive_int_list, default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    cost.add_argument(
        "--num-layers", type=_positive_int, default=None, help="model shape (default Llama-3-8B)"
    )
    cost.add_argument("--num-kv-heads", type=_positive_int, default=None)
    cost.add_argument("--head-dim", type=_positive_int, default=None)
    cost.add_argument("--dtype", choices=("float32", "float16", "bfloat16", "float8"), default=None)
    cost.add_argument("--flops", type=_positive_float, default=None, help="prefill FLOP/s (default 494.5e12)")
    cost.add_argument(
        "--bandwidth", type=_positive_float, default=None, help="host link bytes/s (default 50e9)"
    )
    cost.add_argument("--latency", type=float, default=None, help="seconds per copy (default 5e-6)")
    cost.add_argument("--skip-cpu", action="store_true", help="model only, no CPU measurement")
    cost.add_argument(
        "--cpu-max-context",
        type=_positive_int,
        default=16384,
        help="longest context measured on the CPU (default 16384)",
    )
    cost.set_defaults(handler=_cmd_costmodel)

    add_viz_command(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command in ("costmodel", "demo") and "numpy" not in sys.modules:
        # Time on one core: BLAS threads spinning on a busy machine make timings erratic.
        for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(variable, "1")
    try:
        return int(args.handler(args) or 0)
    except PagedKvError as error:
        print(f"pagedkv {args.command}: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"pagedkv {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"pagedkv {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
