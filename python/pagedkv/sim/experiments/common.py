"""What every experiment shares: allocator order and labels, published numbers, one run's summary."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from pagedkv.errors import InvalidArgumentError
from pagedkv.sim.engine import SimConfig, SimResult, Workload, simulate
from pagedkv.sim.names import ALLOCATOR_LABELS, CONTIGUOUS_ALLOCATORS, PAGED, PLACEMENTS, PREEMPTIONS
from pagedkv.sim.progress import Progress

__all__ = [
    "ALLOCATORS",
    "ALLOCATOR_LABELS",
    "PUBLISHED_FIGURE2_TOKEN_STATES",
    "PUBLISHED_SHARING_SAVINGS",
    "FIGURE2_NUM_SLOTS",
    "Printer",
    "summarize",
    "run_simulation",
    "run_labelled",
]

# Table order: the contiguous policies from most to least wasteful, then paging.
ALLOCATORS = (*CONTIGUOUS_ALLOCATORS, PAGED)
# vLLM paper (Kwon et al., SOSP 2023), Figure 2: share of KV-cache memory holding token states,
# by our allocator label (the paper's Orca Max / Pow2 / Oracle and vLLM).
PUBLISHED_FIGURE2_TOKEN_STATES = {
    ALLOCATOR_LABELS["contiguous-max"]: 0.204,
    ALLOCATOR_LABELS["contiguous-pow2"]: 0.268,
    ALLOCATOR_LABELS["contiguous-oracle"]: 0.382,
    ALLOCATOR_LABELS["paged"]: 0.963,
}
# vLLM paper §6.3: memory saved by sharing on Alpaca (OPT-13B), over n / width 2, 4, 6.
PUBLISHED_SHARING_SAVINGS = {"parallel": (0.061, 0.098), "beam": (0.376, 0.552)}
# A 13B model on a 40 GB GPU leaves room for about 15.7K token slots of KV cache (vLLM Fig. 2 setting).
FIGURE2_NUM_SLOTS = 15_744

Printer = Callable[[str], None]


def summarize(result: SimResult) -> dict:
    """A run's scalar metrics (every key of docs/metrics.md) plus per-request means, without the
    per-request arrays. ``waste`` is the share of the pool neither holding a token nor free:
    reserved + internal fragmentation + external fragmentation (the one definition of waste,
    used by every table, plot and the visualizer)."""
    summary = {
        key: value
        for key, value in result.to_dict().items()
        if key not in ("waste_per_request_tokens", "block_table_len")
    }
    waste = np.asarray(result.waste_per_request_tokens, dtype=np.float64)
    tables = np.asarray(result.block_table_len, dtype=np.float64)
    summary["mean_waste_per_request_tokens"] = float(waste.mean()) if waste.size else 0.0
    summary["mean_block_table_len"] = float(tables.mean()) if tables.size else 0.0
    # Clamped: the shares are floats summing to 1, so a waste-free run may come out as -1e-17.
    summary["waste"] = max(0.0, 1.0 - result.token_states - result.free)
    return summary


def run_simulation(workload: Workload, config: SimConfig, *, progress: bool = False) -> SimResult:
    """`simulate`, after checking the config's names so that a typo is a clear error here."""
    if config.allocator not in ALLOCATORS:
        raise InvalidArgumentError(
            f"allocator must be one of {', '.join(ALLOCATORS)}, got {config.allocator!r}"
        )
    if config.placement not in PLACEMENTS:
        raise InvalidArgumentError(
            f"placement must be one of {', '.join(PLACEMENTS)}, got {config.placement!r}"
        )
    if config.preemption not in PREEMPTIONS:
        raise InvalidArgumentError(
            f"preemption must be one of {', '.join(PREEMPTIONS)}, got {config.preemption!r}"
        )
    return simulate(workload, config, progress=progress)


def run_labelled(
    label: str, configs: Sequence[tuple[str, Workload, SimConfig]], progress: bool
) -> dict[str, SimResult]:
    """Run each ``(name, workload, config)``; results by name, one progress bar ``label``."""
    results: dict[str, SimResult] = {}
    with Progress(len(configs), label, enabled=progress) as bar:
        for name, workload, config in configs:
            results[name] = run_simulation(workload, config)
            bar.update(1, name)
    return results
