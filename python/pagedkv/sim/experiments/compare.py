"""Allocators side by side: one workload, one pool, every allocator."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from pagedkv.sim import workloads as wl
from pagedkv.sim.engine import SimConfig, Workload
from pagedkv.sim.experiments.common import (
    ALLOCATOR_LABELS,
    ALLOCATORS,
    run_labelled,
    summarize,
)
from pagedkv.sim.reports import occupancy_table, shares_table, tokens_per_step_differs


def compare_allocators(
    workload: Workload, config: SimConfig, *, allocators: Sequence[str] = ALLOCATORS, progress: bool = False
) -> dict:
    """The same workload and pool under each allocator: the five shares and the occupancy."""
    runs = [
        (ALLOCATOR_LABELS.get(name, name), workload, dataclasses.replace(config, allocator=name))
        for name in allocators
    ]
    results = run_labelled("compare", runs, progress)
    return {
        "workload": wl.describe(workload),
        "config": dataclasses.asdict(config),
        "results": {label: summarize(result) for label, result in results.items()},
    }


def render_compare(data: Mapping[str, Any], *, title: str = "Allocators on the same memory") -> str:
    config = data["config"]
    heading = (
        f"{title}: {data['workload']['name']}, pool {config['num_slots']:,} token slots, "
        f"max_model_len {config['max_model_len']}, block size {config['block_size']} (paged), "
        f"placement {config['placement']} (contiguous), arrival {config['arrival']}"
    )
    results = data["results"]
    lines = []
    paged = results.get(ALLOCATOR_LABELS["paged"])
    if paged is not None:
        for label, result in results.items():
            if (
                result is paged
                or not result["mean_resident_requests"]
                or not result["generated_tokens_per_step"]
            ):
                continue
            resident = paged["mean_resident_requests"] / result["mean_resident_requests"]
            tokens = paged["generated_tokens_per_step"] / result["generated_tokens_per_step"]
            lines.append(
                f"Paging vs {label}: {resident:.1f}x the resident requests"
                + (f", {tokens:.1f}x the tokens per step" if tokens_per_step_differs(results) else "")
            )
    return "\n\n".join(
        [
            shares_table(results, title=heading),
            occupancy_table(
                results,
                title="Utilization = token states; waste = reserved + internal + external; "
                "'while queued' = over the steps at which a request was waiting",
            ),
            *(["\n".join(lines)] if lines else []),
        ]
    )
