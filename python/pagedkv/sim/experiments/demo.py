"""``pagedkv demo``: the whole PagedAttention story in six sections."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

from pagedkv.sim import workloads as wl
from pagedkv.sim.engine import SimConfig
from pagedkv.sim.experiments.attention_check import attention_check, render_attention_check
from pagedkv.sim.experiments.common import (
    FIGURE2_NUM_SLOTS,
    Printer,
)
from pagedkv.sim.experiments.compare import compare_allocators, render_compare
from pagedkv.sim.experiments.copy_on_write import copy_on_write, render_copy_on_write
from pagedkv.sim.experiments.prefix_caching import prefix_caching, render_prefix_caching
from pagedkv.sim.experiments.recovery import recovery, render_recovery
from pagedkv.sim.experiments.sweep import block_size_sweep, render_sweep

DEMO_SECTIONS = ("attention", "allocators", "block_size_sweep", "copy_on_write", "recovery", "prefix_caching")


def demo(
    *,
    out: Printer = print,
    progress: bool = True,
    num_requests: int = 1000,
    seed: int = 0,
    attention_backend: str = "numpy",
) -> dict:
    """``pagedkv demo``: six sections, each printed as soon as it is done; returns them all.

    (a) paged attention equals contiguous attention; (b) one synthetic workload under contiguous
    and paged allocation with identical memory; (c) waste per request tracks block_size / 2;
    (d) copy-on-write keeps 4 samples of a 1,000-token prompt near 1,000 tokens of cache;
    (e) exhaustion and recovery by recompute and by swap; (f) prefix caching on shared system
    prompts.
    """
    sections: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    workload = wl.synthetic(num_requests, seed=seed)
    same_memory = SimConfig(
        num_slots=FIGURE2_NUM_SLOTS, max_model_len=2048, block_size=16, arrival="saturated", seed=seed
    )

    def section(
        key: str, heading: str, run: Callable[[], dict], render: Callable[[Mapping[str, Any]], str]
    ) -> None:
        start_s = time.perf_counter()
        sections[key] = run()
        seconds[key] = time.perf_counter() - start_s
        out(f"\n=== {heading} ({seconds[key]:.1f} s)\n")
        out(render(sections[key]))

    section(
        "attention",
        "(a) paged attention equals contiguous attention",
        lambda: attention_check(backend=attention_backend),
        render_attention_check,
    )
    section(
        "allocators",
        "(b) one workload, identical memory: contiguous reservation vs paged blocks",
        lambda: compare_allocators(workload, same_memory, progress=progress),
        render_compare,
    )
    section(
        "block_size_sweep",
        "(c) block-size sweep: waste per request ~ block_size / 2",
        lambda: block_size_sweep(workload, same_memory, progress=progress),
        render_sweep,
    )
    section(
        "copy_on_write",
        "(d) copy-on-write: 4 samples of a 1,000-token prompt",
        copy_on_write,
        render_copy_on_write,
    )
    # A pool of a quarter of the memory, so that the decode phase runs out of blocks.
    tight = dataclasses.replace(same_memory, num_slots=FIGURE2_NUM_SLOTS // 4)
    section(
        "recovery",
        "(e) exhaustion and recovery: recompute vs swap",
        lambda: recovery(wl.synthetic(max(50, num_requests // 2), seed=seed), tight, progress=progress),
        render_recovery,
    )
    chat = wl.system_prompt(max(50, num_requests // 2), seed=seed)
    chat_config = dataclasses.replace(same_memory, num_slots=4 * FIGURE2_NUM_SLOTS, arrival="trace")
    section(
        "prefix_caching",
        "(f) prefix caching: 16 shared system prompts of 1,024 tokens",
        lambda: prefix_caching(chat, chat_config, progress=progress),
        render_prefix_caching,
    )
    sections["seconds"] = seconds
    out(f"\nDemo done in {sum(seconds.values()):.1f} s.")
    return sections
