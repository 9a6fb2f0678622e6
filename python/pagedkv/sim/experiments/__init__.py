"""The experiments of the PagedAttention story, as functions returning JSON-ready dicts.

One module per experiment; each has a ``render_*`` companion that turns its dict into the printed
tables, so the command line, the demo and a notebook print the same thing. Simulations go through
`pagedkv.sim.engine.simulate`; the copy-on-write and sharing experiments drive the real
`pagedkv.KvCacheManager` directly.

=================  =====================================================================
module             experiment
=================  =====================================================================
common             allocator order, published numbers, `summarize` one run
compare            every allocator on one workload and pool (`compare_allocators`)
figure2            the vLLM paper's Figure 2 setting (`figure2`)
sweep              block size 1..256: waste per request vs table length (`block_size_sweep`)
sharing            blocks saved by parallel sampling and beam search (`sharing_savings`)
copy_on_write      samples forked from one prompt (`copy_on_write`)
attention_check    paged attention equals contiguous attention (`attention_check`)
recovery           exhaustion and recovery, recompute vs swap (`recovery`)
recompute_or_swap  the cost model's table and a CPU measurement (`recompute_or_swap`)
prefix_caching     shared system prompts, caching off and on (`prefix_caching`)
demo               all of the above in six sections (`demo`)
=================  =====================================================================
"""

from pagedkv.sim.experiments.attention_check import attention_check, render_attention_check
from pagedkv.sim.experiments.common import (
    ALLOCATOR_LABELS,
    ALLOCATORS,
    FIGURE2_NUM_SLOTS,
    PUBLISHED_FIGURE2_TOKEN_STATES,
    PUBLISHED_SHARING_SAVINGS,
    run_simulation,
    summarize,
)
from pagedkv.sim.experiments.compare import compare_allocators, render_compare
from pagedkv.sim.experiments.copy_on_write import copy_on_write, render_copy_on_write
from pagedkv.sim.experiments.demo import DEMO_SECTIONS, demo
from pagedkv.sim.experiments.figure2 import figure2, render_figure2
from pagedkv.sim.experiments.prefix_caching import prefix_caching, render_prefix_caching
from pagedkv.sim.experiments.recompute_or_swap import recompute_or_swap, render_recompute_or_swap
from pagedkv.sim.experiments.recovery import recovery, render_recovery
from pagedkv.sim.experiments.sharing import render_sharing, sharing_savings
from pagedkv.sim.experiments.sweep import block_size_sweep, render_sweep

__all__ = [
    "ALLOCATORS",
    "ALLOCATOR_LABELS",
    "PUBLISHED_FIGURE2_TOKEN_STATES",
    "PUBLISHED_SHARING_SAVINGS",
    "FIGURE2_NUM_SLOTS",
    "DEMO_SECTIONS",
    "summarize",
    "run_simulation",
    "compare_allocators",
    "render_compare",
    "figure2",
    "render_figure2",
    "block_size_sweep",
    "render_sweep",
    "sharing_savings",
    "render_sharing",
    "copy_on_write",
    "render_copy_on_write",
    "attention_check",
    "render_attention_check",
    "recovery",
    "render_recovery",
    "recompute_or_swap",
    "render_recompute_or_swap",
    "prefix_caching",
    "render_prefix_caching",
    "demo",
]
