"""Exhaustion and recovery: recompute against swap on one workload, priced by the cost model."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from pagedkv.sim import workloads as wl
from pagedkv.sim.costmodel import CostModel
from pagedkv.sim.engine import SimConfig, Workload
from pagedkv.sim.experiments.common import (
    run_labelled,
    summarize,
)
from pagedkv.sim.reports import format_table


def _recovery_seconds(
    summary: Mapping[str, Any], cost_model: CostModel, block_size: int, baseline_prefill_tokens: int
) -> dict:
    """Time a run's preemptions add on top of the step clock, priced by the cost model.

    Recompute: the re-prefilled tokens, priced as prefills of the mean recomputed context (a
    swap run falls back to recompute when the swap tier is full, so both runs may have some).
    Swap: the blocks copied in both directions, priced per byte and per copy.
    """
    if "recomputed_tokens" in summary:
        recomputed_tokens = int(summary["recomputed_tokens"])
    else:
        recomputed_tokens = max(int(summary["prefill_tokens"]) - baseline_prefill_tokens, 0)
    recompute_preemptions = int(summary.get("recompute_preemptions", summary["preemptions"]))
    recompute_s = 0.0
    if recompute_preemptions and recomputed_tokens:
        mean_context = max(1, round(recomputed_tokens / recompute_preemptions))
        recompute_s = recompute_preemptions * cost_model.recompute_s(mean_context)
    if "swapped_out_blocks" in summary:
        swapped_blocks = int(summary["swapped_out_blocks"]) + int(summary.get("swapped_in_blocks", 0))
    else:
        swapped_blocks = int(summary.get("swapped_blocks", 0))
    bytes_moved = swapped_blocks * block_size * cost_model.model.kv_bytes_per_token
    swap_s = (
        bytes_moved / cost_model.hardware.host_link_bytes_per_s
        + swapped_blocks * cost_model.copies_per_block() * cost_model.hardware.per_transfer_latency_s
    )
    return {
        "recomputed_tokens": recomputed_tokens,
        "recompute_overhead_s": recompute_s,
        "copied_blocks": swapped_blocks,
        "bytes_moved": bytes_moved,
        "swap_overhead_s": swap_s,
        "preemption_overhead_s": recompute_s + swap_s,
    }


def recovery(
    workload: Workload, config: SimConfig, *, cost_model: CostModel | None = None, progress: bool = False
) -> dict:
    """Run out of blocks on purpose and recover, once by recompute and once by swap.

    Both runs use the same device pool; the swap run gets a swap tier as large as the device
    pool unless the config sets one. End-to-end time = the simulated clock (steps x step time,
    plus idle gaps between trace arrivals) + the preemption overhead from the cost model (an H200
    with Llama-3-8B by default); tokens per second follow.
    """
    cost_model = cost_model or CostModel()
    host_slots = config.num_host_slots or config.num_slots
    runs = [
        ("recompute", workload, dataclasses.replace(config, allocator="paged", preemption="recompute")),
        (
            "swap",
            workload,
            dataclasses.replace(config, allocator="paged", preemption="swap", num_host_slots=host_slots),
        ),
    ]
    start_s = time.perf_counter()
    results = run_labelled("recovery", runs, progress)
    wall_s = time.perf_counter() - start_s
    baseline_prefill_tokens = int(np.sum(workload.prompt_tokens))
    rows = {}
    for policy, result in results.items():
        summary = summarize(result)
        summary.update(_recovery_seconds(summary, cost_model, config.block_size, baseline_prefill_tokens))
        end_to_end_s = summary["simulated_seconds"] + summary["preemption_overhead_s"]
        summary["end_to_end_s"] = end_to_end_s
        summary["generated_tokens_per_s"] = (
            summary["generated_tokens"] / end_to_end_s if end_to_end_s > 0 else 0.0
        )
        rows[policy] = summary
    return {
        "workload": wl.describe(workload),
        "config": dataclasses.asdict(config),
        "cost_model": {
            "model": dataclasses.asdict(cost_model.model),
            "hardware": dataclasses.asdict(cost_model.hardware),
        },
        "results": rows,
        "simulation_wall_s": wall_s,
    }


def render_recovery(data: Mapping[str, Any]) -> str:
    config = data["config"]
    rows = []
    for policy, result in data["results"].items():
        rows.append(
            [
                policy,
                result["preemptions"],
                result["finished_requests"],
                result["steps"],
                result["recomputed_tokens"],
                result["copied_blocks"],
                result["bytes_moved"] / 2**20,
                result["preemption_overhead_s"],
                result["generated_tokens_per_s"],
            ]
        )
    model = data["cost_model"]
    return format_table(
        [
            "policy",
            "preemptions",
            "finished",
            "steps",
            "recomputed tokens",
            "blocks copied",
            "MiB moved",
            "overhead (s)",
            "tokens/s",
        ],
        rows,
        title=(
            f"Exhaustion and recovery: {data['workload']['name']}, pool {config['num_slots']:,} slots, "
            f"block size {config['block_size']}, arrival {config['arrival']}"
        ),
        note=(
            f"Time = simulated clock (steps x {config['step_time_s']} s, plus idle gaps between arrivals) + "
            f"preemption overhead priced by the cost model "
            f"({model['model']['name']} on {model['hardware']['name']})."
        ),
    )
