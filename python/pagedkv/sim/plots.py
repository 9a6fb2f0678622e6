"""PNG plots of the experiments (matplotlib, Agg backend, imported only when a plot is asked for)."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Mapping
from typing import Any

from pagedkv.errors import PlotUnavailableError
from pagedkv.sim.names import allocator_label
from pagedkv.sim.reports import SHARE_KEYS, SHARE_LABELS, result_field

__all__ = [
    "PlotUnavailableError",
    "plot_shares",
    "plot_sweep",
    "plot_costmodel",
    "plot_simulation",
    "plot_sharing",
    "plot_recovery",
    "plot_demo",
    "plot_viz_runs",
]

SHARE_COLORS = {
    "token_states": "#2a9d8f",
    "reserved": "#e9c46a",
    "internal_fragmentation": "#f4a261",
    "external_fragmentation": "#e76f51",
    "free": "#d9d9d9",
}


# Large enough to read at the PNG's natural size (the matplotlib default of 10 is small at 110 dpi).
FONT_SIZE = 11


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as error:
        raise PlotUnavailableError(
            "plotting needs matplotlib: pip install matplotlib (or, in a pagedkv checkout, "
            "pip install '.[plot]')"
        ) from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": FONT_SIZE, "axes.titlesize": FONT_SIZE, "legend.fontsize": 9})
    return plt


def _save(figure: Any, path: str | os.PathLike) -> None:
    figure.tight_layout()
    # "tight" keeps legends placed outside the axes (off the data) inside the image.
    figure.savefig(os.fspath(path), dpi=110, bbox_inches="tight")
    _pyplot().close(figure)


def _wrapped(label: str, width: int = 16) -> str:
    """A tick label on several short lines rather than one long, overlapping one."""
    return textwrap.fill(label, width, break_long_words=False)


def _legend_outside(axis: Any, *args: Any) -> None:
    """The legend to the right of the axes, never over the data."""
    axis.legend(*args, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)


def _draw_shares(axis: Any, results: Mapping[str, Any], published: Mapping[str, float] | None = None) -> None:
    labels = [_wrapped(label) for label in results]
    keys = list(results)
    bottoms = [0.0] * len(labels)
    for key in SHARE_KEYS:
        values = [100.0 * result_field(results[label], key) for label in keys]
        axis.bar(labels, values, bottom=bottoms, color=SHARE_COLORS[key], label=SHARE_LABELS[key])
        bottoms = [bottom + value for bottom, value in zip(bottoms, values, strict=True)]
    for index, label in enumerate(keys):
        token_share = 100.0 * result_field(results[label], "token_states")
        axis.text(index, token_share / 2, f"{token_share:.1f}%", ha="center", va="center", fontsize=9)
        if published and label in published:
            axis.plot(
                [index - 0.4, index + 0.4], [100.0 * published[label]] * 2, color="black", linestyle="--"
            )
    if published:
        axis.plot([], [], color="black", linestyle="--", label="published token states")
    axis.set_ylabel("share of the KV pool (%)")
    axis.set_xlabel("allocator")
    axis.set_ylim(0, 100)
    _legend_outside(axis)


def plot_shares(
    results: Mapping[str, Any],
    path: str | os.PathLike,
    *,
    title: str,
    published_token_states: Mapping[str, float] | None = None,
) -> None:
    """Stacked bars: the five time-averaged shares of the pool for each run."""
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(8, 4.5))
    _draw_shares(axis, results, published_token_states)
    axis.set_title(title)
    _save(figure, path)


def _draw_sweep(axis: Any, sweep: Mapping[str, Any]) -> None:
    rows = sweep["rows"]
    block_sizes = [row["block_size"] for row in rows]
    axis.plot(
        block_sizes,
        [row["mean_waste_per_request_tokens"] for row in rows],
        "o-",
        color="#e76f51",
        label="waste per request (tokens)",
    )
    axis.plot(
        block_sizes, [row["block_size"] / 2 for row in rows], ":", color="#e76f51", label="block_size / 2"
    )
    axis.plot(
        block_sizes,
        [row["mean_block_table_len"] for row in rows],
        "s-",
        color="#264653",
        label="block-table length (entries)",
    )
    # Block size 1 wastes nothing: a plain log axis would drop that point, symlog keeps 0 on it.
    axis.set_xscale("log", base=2)
    axis.set_yscale("symlog", linthresh=1.0)
    axis.set_xticks(block_sizes, [str(b) for b in block_sizes])
    axis.set_xlabel("block size (tokens)")
    axis.set_ylabel("tokens (waste) or entries (table), per request")
    crossing = sweep.get("crossing_block_size")
    if crossing:
        axis.axvline(crossing, color="gray", linestyle="--")
        axis.annotate(
            f"crossing ~{crossing:.0f}",
            (crossing, sweep["crossing_value"]),
            textcoords="offset points",
            xytext=(6, 6),
            fontsize=9,
        )
    utilization_axis = axis.twinx()
    utilization_axis.plot(
        block_sizes,
        [100.0 * row["token_states"] for row in rows],
        "^--",
        color="#2a9d8f",
        label="utilization (%)",
    )
    utilization_axis.set_ylabel("utilization: token states (%)")
    utilization_axis.set_ylim(0, 100)
    lines = axis.get_legend_handles_labels()
    more = utilization_axis.get_legend_handles_labels()
    # Right of the utilization axis's labels.
    axis.legend(
        lines[0] + more[0],
        lines[1] + more[1],
        loc="upper left",
        bbox_to_anchor=(1.15, 1.0),
        borderaxespad=0.0,
    )


def plot_sweep(sweep: Mapping[str, Any], path: str | os.PathLike, *, title: str) -> None:
    """Block-size sweep: waste per request and block-table length (log-log), crossing marked;
    utilization on the right axis."""
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(8, 4.5))
    _draw_sweep(axis, sweep)
    axis.set_title(title)
    _save(figure, path)


def plot_costmodel(
    model_table: Mapping[str, Any], cpu: Mapping[str, Any] | None, path: str | os.PathLike
) -> None:
    """Recompute vs swap seconds over the context, one swap curve per block size: the model's
    accelerator on the left, the CPU measurement on the right (when given)."""
    plt = _pyplot()
    panels = [(model_table, f"model: {model_table['model']['name']} on {model_table['hardware']['name']}")]
    if cpu is not None:
        panels.append((cpu, f"measured on this CPU: {cpu['shape']['name']} prefill vs NumPy block copies"))
    figure, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    for axis, (table, title) in zip(axes[0], panels, strict=True):
        contexts = table["contexts_tokens"]
        axis.plot(contexts, table["recompute_s"], "k-", linewidth=2.5, label="recompute")
        colormap = plt.get_cmap("viridis")
        for index, (block_size, row) in enumerate(zip(table["block_sizes"], table["swap_s"], strict=True)):
            color = colormap(index / max(1, len(table["block_sizes"]) - 1))
            axis.plot(contexts, row, "-", color=color, label=f"swap, block {block_size}")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("context (tokens)")
        axis.set_ylabel("seconds per preemption")
        axis.set_title(_wrapped(title, 60))
        _legend_outside(axis)
    _save(figure, path)


def plot_simulation(result: Any, path: str | os.PathLike, *, title: str) -> None:
    """One run: its pool shares, and the histogram of waste per finished request."""
    plt = _pyplot()
    figure, (shares_axis, waste_axis) = plt.subplots(1, 2, figsize=(10, 4.5))
    _draw_shares(shares_axis, {"this run": result})
    waste = list(result_field(result, "waste_per_request_tokens"))
    waste_axis.hist(waste if waste else [0.0], bins=40, color="#e76f51")
    waste_axis.set_xlabel("waste per finished request (token slots)")
    waste_axis.set_ylabel("requests")
    figure.suptitle(title)
    _save(figure, path)


def _draw_sharing(axis: Any, sharing: Mapping[str, Any]) -> None:
    rows = sharing["rows"]
    positions = list(range(len(rows)))
    axis.bar(positions, [100.0 * row["blocks_saved"] for row in rows], color="#2a9d8f", label="ours")
    published = sharing.get("published", {})
    for index, row in enumerate(rows):
        bounds = published.get(row["kind"]) if row["workload"] == "alpaca" else None
        if bounds:
            axis.plot(
                [index - 0.4, index + 0.4],
                [100.0 * bounds[0]] * 2,
                color="black",
                linestyle="--",
                linewidth=1,
            )
            axis.plot(
                [index - 0.4, index + 0.4],
                [100.0 * bounds[1]] * 2,
                color="black",
                linestyle="--",
                linewidth=1,
            )
    axis.plot([], [], color="black", linestyle="--", label="published range (Alpaca, n/width 2-6)")
    axis.set_xticks(
        positions, [f"{row['kind']} {row['width']}\n{row['workload']}" for row in rows], fontsize=9
    )
    axis.set_xlabel("group kind, width / n, workload")
    axis.set_ylabel("blocks saved vs no sharing (%)")
    _legend_outside(axis)


def plot_sharing(sharing: Mapping[str, Any], path: str | os.PathLike, *, title: str) -> None:
    """Share of blocks saved by sharing, per group kind and width, beside the published range."""
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(10, 4.5))
    _draw_sharing(axis, sharing)
    axis.set_title(title)
    _save(figure, path)


def _draw_recovery(time_axis: Any, throughput_axis: Any, recovery: Mapping[str, Any]) -> None:
    results = recovery["results"]
    policies = list(results)
    positions = range(len(policies))
    clock = [results[p]["simulated_seconds"] for p in policies]
    overhead = [results[p]["preemption_overhead_s"] for p in policies]
    time_axis.bar(positions, clock, color="#264653", label="simulated clock")
    time_axis.bar(positions, overhead, bottom=clock, color="#e76f51", label="preemption overhead")
    time_axis.set_xticks(list(positions), policies)
    time_axis.set_xlabel("preemption policy")
    time_axis.set_ylabel("end-to-end time (s)")
    _legend_outside(time_axis)
    throughput_axis.bar(positions, [results[p]["generated_tokens_per_s"] for p in policies], color="#2a9d8f")
    throughput_axis.set_xticks(list(positions), policies)
    throughput_axis.set_xlabel("preemption policy")
    throughput_axis.set_ylabel("generated tokens per second")
    for index, policy in enumerate(policies):
        throughput_axis.annotate(
            f"{results[policy]['preemptions']:,} preemptions",
            (index, 0),
            textcoords="offset points",
            xytext=(0, 4),
            ha="center",
            fontsize=9,
            color="white",
        )


def plot_recovery(recovery: Mapping[str, Any], path: str | os.PathLike, *, title: str) -> None:
    """Exhaustion and recovery: end-to-end time (clock + preemption overhead) and throughput of
    recompute against swap."""
    plt = _pyplot()
    figure, (time_axis, throughput_axis) = plt.subplots(1, 2, figsize=(10, 4.5))
    _draw_recovery(time_axis, throughput_axis, recovery)
    figure.suptitle(title)
    _save(figure, path)


def _draw_attention(axis: Any, check: Mapping[str, Any]) -> None:
    rows = check["rows"]
    positions = list(range(len(rows)))
    # A difference of exactly 0 cannot sit on a log axis: show it at the axis floor.
    floor = 1e-10
    axis.bar(positions, [max(row["max_abs_diff"], floor) for row in rows], color="#264653")
    axis.axhline(
        check["tolerance"], color="#e76f51", linestyle="--", label=f"tolerance {check['tolerance']:g}"
    )
    axis.set_yscale("log")
    axis.set_ylim(floor / 2, check["tolerance"] * 10)
    axis.set_xticks(positions, [f"{row['seq_len']:,}" for row in rows])
    axis.set_xlabel("sequence length (tokens)")
    axis.set_ylabel("max |paged - contiguous|")
    _legend_outside(axis)


def _draw_copy_on_write(axis: Any, cow: Mapping[str, Any]) -> None:
    stages = cow["stages"]
    positions = list(range(len(stages)))
    width = 0.4
    axis.bar(
        [p - width / 2 for p in positions],
        [s["unshared_blocks"] for s in stages],
        width,
        color="#d9d9d9",
        label="blocks if unshared",
    )
    axis.bar(
        [p + width / 2 for p in positions],
        [s["blocks_in_use"] for s in stages],
        width,
        color="#2a9d8f",
        label="blocks in use (shared)",
    )
    axis.set_xticks(positions, [_wrapped(s["stage"], 22) for s in stages])
    axis.set_xlabel("stage")
    axis.set_ylabel("KV blocks")
    _legend_outside(axis)


def _draw_prefix_caching(axis: Any, caching: Mapping[str, Any]) -> None:
    results = caching["results"]
    runs = list(results)
    positions = list(range(len(runs)))
    axis.bar(positions, [results[r]["prefill_tokens"] for r in runs], color="#e9c46a")
    axis.set_xticks(positions, runs)
    axis.set_xlabel("prefix caching")
    axis.set_ylabel("prefill tokens computed")
    axis.annotate(
        f"hit rate {100 * caching['hit_rate']:.1f} %, "
        f"prefill saved {100 * caching['prefill_tokens_saved']:.1f} %",
        (0.5, 0.95),
        xycoords="axes fraction",
        ha="center",
        va="top",
    )


def plot_demo(demo: Mapping[str, Any], path: str | os.PathLike) -> None:
    """All six sections of the demo, one panel each: (a) attention check, (b) allocator shares,
    (c) block-size sweep, (d) copy-on-write, (e) exhaustion and recovery, (f) prefix caching."""
    plt = _pyplot()
    figure, axes = plt.subplots(3, 2, figsize=(16, 15))
    (attention_axis, shares_axis), (sweep_axis, cow_axis), (recovery_axis, caching_axis) = axes
    _draw_attention(attention_axis, demo["attention"])
    attention_axis.set_title("(a) paged attention = contiguous attention")
    _draw_shares(shares_axis, demo["allocators"]["results"])
    shares_axis.set_title("(b) same memory, contiguous vs paged")
    _draw_sweep(sweep_axis, demo["block_size_sweep"])
    sweep_axis.set_title("(c) block-size sweep")
    _draw_copy_on_write(cow_axis, demo["copy_on_write"])
    cow_axis.set_title("(d) copy-on-write")
    # Recovery: end-to-end time per policy (its throughput is in the printed table).
    results = demo["recovery"]["results"]
    policies = list(results)
    clock = [results[p]["simulated_seconds"] for p in policies]
    overhead = [results[p]["preemption_overhead_s"] for p in policies]
    recovery_axis.bar(policies, clock, color="#264653", label="simulated clock")
    recovery_axis.bar(policies, overhead, bottom=clock, color="#e76f51", label="preemption overhead")
    recovery_axis.set_xlabel("preemption policy")
    recovery_axis.set_ylabel("end-to-end time (s)")
    _legend_outside(recovery_axis)
    recovery_axis.set_title("(e) exhaustion and recovery")
    _draw_prefix_caching(caching_axis, demo["prefix_caching"])
    caching_axis.set_title("(f) prefix caching")
    _save(figure, path)


def plot_viz_runs(data: Mapping[str, Any], path: str | os.PathLike) -> None:
    """The visualizer's runs (``pagedkv viz --plot``): running requests and waste over the steps,
    every allocator, at the block size and seed the page shows first."""
    plt = _pyplot()
    first = data["initial"]
    runs = [r for r in data["runs"] if r["block_size"] == first["block_size"] and r["seed"] == first["seed"]]
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for run in runs:
        top.plot(run["c"]["step"], run["c"]["running"], label=allocator_label(run["allocator"]))
        bottom.plot(run["c"]["step"], run["c"]["waste_pct"], label=allocator_label(run["allocator"]))
    top.set_ylabel("running requests")
    bottom.set_ylabel("waste (% of the pool)")
    bottom.set_xlabel("engine step")
    top.set_title(
        f"same {data['num_slots']}-slot pool, block size {first['block_size']}, seed {first['seed']}"
    )
    _legend_outside(top)
    _save(figure, path)
