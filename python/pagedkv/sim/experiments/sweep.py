"""The block-size sweep: waste per request against block-table length."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from pagedkv.sim import workloads as wl
from pagedkv.sim.engine import SimConfig, Workload
from pagedkv.sim.experiments.common import (
    run_labelled,
    summarize,
)
from pagedkv.sim.reports import Number, Percent, format_table


def _crossing(
    block_sizes: Sequence[float], waste: Sequence[float], table_len: Sequence[float]
) -> tuple[float, float] | None:
    """Where waste per request (growing with the block size) meets block-table length (falling),
    interpolated linearly in log2(block size) and log(value); None if they never cross."""
    for index in range(len(block_sizes) - 1):
        gap_here = math.log(max(waste[index], 1e-9)) - math.log(max(table_len[index], 1e-9))
        gap_next = math.log(max(waste[index + 1], 1e-9)) - math.log(max(table_len[index + 1], 1e-9))
        if gap_here <= 0 <= gap_next and gap_next != gap_here:
            fraction = -gap_here / (gap_next - gap_here)
            x_here, x_next = math.log2(block_sizes[index]), math.log2(block_sizes[index + 1])
            block_size = 2 ** (x_here + fraction * (x_next - x_here))
            value = math.exp(
                math.log(max(table_len[index], 1e-9))
                + fraction
                * (math.log(max(table_len[index + 1], 1e-9)) - math.log(max(table_len[index], 1e-9)))
            )
            return block_size, value
    return None


def block_size_sweep(
    workload: Workload,
    config: SimConfig,
    *,
    block_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256),
    progress: bool = False,
) -> dict:
    """Paged allocation at each block size on the same pool: utilization, waste per finished
    request (which tracks block_size / 2) and block-table length (which falls as 1 / block_size).

    The crossing is where the two per-request costs are equal, one token slot of waste against
    one table entry: the classic page-size trade-off, whose optimum sqrt(2 * mean length) it
    approximates.
    """
    runs = [
        (str(block_size), workload, dataclasses.replace(config, allocator="paged", block_size=block_size))
        for block_size in block_sizes
    ]
    results = run_labelled("sweep", runs, progress)
    rows = []
    for block_size, result in zip(block_sizes, results.values(), strict=True):
        summary = summarize(result)
        rows.append(
            {
                "block_size": int(block_size),
                "token_states": summary["token_states"],
                "waste": summary["waste"],
                "mean_waste_per_request_tokens": summary["mean_waste_per_request_tokens"],
                "waste_over_half_block": summary["mean_waste_per_request_tokens"] / (block_size / 2.0),
                "mean_block_table_len": summary["mean_block_table_len"],
                "mean_resident_requests": summary["mean_resident_requests"],
                "generated_tokens_per_step": summary["generated_tokens_per_step"],
                "preemptions": summary["preemptions"],
            }
        )
    crossing = _crossing(
        [row["block_size"] for row in rows],
        [row["mean_waste_per_request_tokens"] for row in rows],
        [row["mean_block_table_len"] for row in rows],
    )
    return {
        "workload": wl.describe(workload),
        "config": dataclasses.asdict(config),
        "rows": rows,
        "crossing_block_size": crossing[0] if crossing else None,
        "crossing_value": crossing[1] if crossing else None,
        "results": {
            str(row["block_size"]): summarize(result)
            for row, result in zip(rows, results.values(), strict=True)
        },
    }


def render_sweep(data: Mapping[str, Any]) -> str:
    config = data["config"]
    rows = [
        [
            row["block_size"],
            Percent(row["token_states"]),
            Percent(row["waste"]),
            row["mean_waste_per_request_tokens"],
            row["block_size"] / 2,
            Number(row["waste_over_half_block"], ".2f"),
            row["mean_block_table_len"],
            row["mean_resident_requests"],
            row["preemptions"],
        ]
        for row in data["rows"]
    ]
    crossing = data.get("crossing_block_size")
    note = (
        f"Waste per request equals block-table length at block size ~{crossing:.0f} "
        f"({data['crossing_value']:.1f} tokens = entries per request)"
        if crossing
        else "Waste per request and block-table length do not cross in this range"
    )
    note += (
        "\nFor lengths spread evenly over a block the expected waste is (block_size - 1) / 2, "
        "hence ratios a little under 1."
    )
    return format_table(
        [
            "block size",
            "utilization",
            "waste",
            "waste/request (tok)",
            "block/2",
            "ratio",
            "table len",
            "mean resident",
            "preemptions",
        ],
        rows,
        title=(
            f"Block-size sweep: {data['workload']['name']}, pool {config['num_slots']:,} slots, "
            f"arrival {config['arrival']}"
        ),
        note=note,
    )
