"""Prefix caching on shared system prompts: the same workload with caching off and on."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from pagedkv.sim import workloads as wl
from pagedkv.sim.engine import SimConfig, Workload
from pagedkv.sim.experiments.common import (
    run_labelled,
    summarize,
)
from pagedkv.sim.reports import Percent, format_table, percent


def prefix_caching(workload: Workload, config: SimConfig, *, progress: bool = False) -> dict:
    """The same shared-system-prompt workload with prefix caching off and on (paged allocator).

    Hit rate = prefix-cache hit tokens / prompt tokens looked up. Memory saved = 1 - pool in use
    (everything but free and external fragmentation, time-averaged) with caching / without.
    Prefill saved = 1 - prefill tokens computed with caching / without.
    """
    runs = [
        (
            "caching off",
            workload,
            dataclasses.replace(config, allocator="paged", enable_prefix_caching=False),
        ),
        ("caching on", workload, dataclasses.replace(config, allocator="paged", enable_prefix_caching=True)),
    ]
    results = {
        label: summarize(result) for label, result in run_labelled("prefix caching", runs, progress).items()
    }
    off, on = results["caching off"], results["caching on"]

    def in_use(summary: Mapping[str, Any]) -> float:
        return 1.0 - summary["free"] - summary["external_fragmentation"]

    return {
        "workload": wl.describe(workload),
        "config": dataclasses.asdict(config),
        "results": results,
        "hit_rate": on["prefix_hit_tokens"] / on["prefix_query_tokens"] if on["prefix_query_tokens"] else 0.0,
        "memory_saved": 1.0 - in_use(on) / in_use(off) if in_use(off) > 0 else 0.0,
        "prefill_tokens_saved": 1.0 - on["prefill_tokens"] / off["prefill_tokens"]
        if off["prefill_tokens"]
        else 0.0,
    }


def render_prefix_caching(data: Mapping[str, Any]) -> str:
    config = data["config"]
    rows = []
    for label, result in data["results"].items():
        hit_rate = (
            result["prefix_hit_tokens"] / result["prefix_query_tokens"]
            if result["prefix_query_tokens"]
            else 0.0
        )
        rows.append(
            [
                label,
                Percent(hit_rate),
                Percent(1.0 - result["free"] - result["external_fragmentation"]),
                result["prefill_tokens"],
                result["mean_resident_requests"],
                result["steps"],
            ]
        )
    return format_table(
        ["run", "hit rate", "pool in use", "prefill tokens", "mean resident", "steps"],
        rows,
        title=(
            f"Prefix caching: {data['workload']['name']}, pool {config['num_slots']:,} slots, block size "
            f"{config['block_size']}, arrival {config['arrival']}"
        ),
        note=(
            f"hit rate {percent(data['hit_rate'])}, memory saved {percent(data['memory_saved'])}, "
            f"prefill tokens saved {percent(data['prefill_tokens_saved'])}"
        ),
    )
