"""Recompute or swap? The cost model's table for an accelerator, and a measurement on this CPU
with the model's parameters fitted to it (``pagedkv costmodel``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pagedkv.errors import InvalidArgumentError
from pagedkv.sim.costmodel import CostModel
from pagedkv.sim.progress import Progress
from pagedkv.sim.reports import Number, Percent, format_table

__all__ = ["recompute_or_swap", "render_recompute_or_swap"]


def recompute_or_swap(
    cost_model: CostModel,
    contexts_tokens: Sequence[int],
    block_sizes: Sequence[int],
    *,
    measure_cpu: bool = True,
    cpu_max_context_tokens: int = 16384,
    progress: bool = False,
) -> dict[str, Any]:
    """The model's seconds per preemption at each context and block size (``model``) and, with
    ``measure_cpu``, the same measured on this CPU up to ``cpu_max_context_tokens`` with the
    fitted CPU parameters (``cpu``, absent without the measurement)."""
    from pagedkv.sim import cpu_calibration

    data: dict[str, Any] = {"model": cost_model.table(contexts_tokens, block_sizes)}
    if measure_cpu:
        cpu_contexts = [c for c in contexts_tokens if c <= cpu_max_context_tokens]
        if not cpu_contexts:
            raise InvalidArgumentError(
                f"no context of {list(contexts_tokens)} is within cpu_max_context_tokens="
                f"{cpu_max_context_tokens} to measure on the CPU"
            )
        with Progress(len(cpu_contexts) * (1 + len(block_sizes)), "measuring", enabled=progress) as bar:
            measurement = cpu_calibration.measure_cpu(
                cpu_contexts, block_sizes, on_step=lambda note: bar.update(1, note)
            )
        data["cpu"] = measurement.to_dict()
    return data


def _cost_table(table: Mapping[str, Any], *, title: str, crossover_note: str) -> str:
    """Milliseconds per preemption (one fixed-point unit for every cell: no switch to scientific
    notation), ``*`` where swapping beats recomputing, and where swapping starts to win."""
    contexts = table["contexts_tokens"]
    headers = ["milliseconds", *(f"{c:,} tok" for c in contexts)]
    rows: list[list[Any]] = [["recompute", *(Number(1e3 * s, ",.3f", " ") for s in table["recompute_s"])]]
    for block_size, row in zip(table["block_sizes"], table["swap_s"], strict=True):
        rows.append(
            [
                f"swap, block {block_size}",
                *(
                    Number(1e3 * s, ",.3f", "*" if s < r else " ")
                    for s, r in zip(row, table["recompute_s"], strict=True)
                ),
            ]
        )
    largest = max(contexts)
    crossings = []
    extrapolated = False
    for block_size, crossover in zip(table["block_sizes"], table["crossover_context_tokens"], strict=True):
        if crossover is None:
            crossings.append(f"block {block_size}: > {largest:,}")
        elif crossover > largest:
            crossings.append(f"block {block_size}: {crossover:,}+")
            extrapolated = True
        else:
            crossings.append(f"block {block_size}: {crossover:,}")
    note = f"* swap cheaper. Swap wins from context (tokens): {', '.join(crossings)}"
    if extrapolated:
        note += f"\n+ beyond the largest context in this table ({largest:,} tokens): {crossover_note}"
    return format_table(headers, rows, title=title, note=note)


def render_recompute_or_swap(data: Mapping[str, Any]) -> str:
    model = data["model"]
    shape, hardware = model["model"], model["hardware"]
    parts = [
        _cost_table(
            model,
            title=(
                f"Model (computed from the formulas, not measured): {shape['name']} "
                f"({shape['num_layers']} layers, {shape['num_kv_heads']} KV heads x {shape['head_dim']}, "
                f"{shape['dtype']}) on {hardware['name']}: "
                f"{hardware['prefill_flops_per_s'] / 1e12:,.0f} TFLOP/s prefill, "
                f"{hardware['host_link_bytes_per_s'] / 1e9:,.0f} GB/s, "
                f"{hardware['per_transfer_latency_s'] * 1e6:.1f} us per copy"
            ),
            crossover_note="the model extrapolated (found by bisection up to 1,048,576 tokens)",
        )
    ]
    cpu = data.get("cpu")
    if cpu is not None:
        cpu_shape = cpu["shape"]
        parts.append(
            _cost_table(
                cpu,
                title=(
                    f"Measured on this CPU: {cpu_shape['name']} NumPy prefill ({cpu_shape['num_layers']} "
                    f"layer, hidden {cpu_shape['hidden_size']}, {cpu_shape['num_q_heads']}/"
                    f"{cpu_shape['num_kv_heads']} heads x {cpu_shape['head_dim']}, fp32) vs one NumPy copy "
                    "per block per layer per K/V"
                ),
                crossover_note="not measured",
            )
        )
        fitted = cpu["fitted"]
        parts.append(
            format_table(
                ["fitted CPU parameter", "value"],
                [
                    ["matmul rate (GFLOP/s)", Number(fitted["linear_flops_per_s"] / 1e9)],
                    ["attention rate (GFLOP/s)", Number(fitted["attention_flops_per_s"] / 1e9)],
                    ["copy bandwidth (GB/s)", Number(fitted["copy_bytes_per_s"] / 1e9)],
                    ["per-copy latency (us)", Number(fitted["per_copy_latency_s"] * 1e6)],
                    ["recompute fit, worst error", Percent(fitted["recompute_max_rel_error"])],
                    ["swap fit, worst error", Percent(fitted["swap_max_rel_error"])],
                ],
                note=f"fitted to contexts of {min(cpu['contexts_tokens']):,} to "
                f"{max(cpu['contexts_tokens']):,} tokens; predictions beyond them are extrapolations",
            )
        )
    return "\n\n".join(parts)
