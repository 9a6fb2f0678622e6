"""Differential conformance of hybrid KV groups against vLLM v1's real hybrid ``KVCacheManager``.

Runs the comparison of ``benches/vllm_hybrid_differential.py`` (see its docstring) on a few
seeded schedules per configuration, both managers allocating per scheduled chunk: a
full-attention group and sliding-window groups (a window of one block, windows of 6, 10, 40 and
512 tokens, two windows at once) under chunked prefill, decode across window boundaries, async
ids, speculative drafts and lookahead, frees, preemptions and evictions. Every
admission's hit equals vLLM's ``get_computed_blocks`` hit and pagedkv's ``match_prefix``; blocks
in use agree in total and per group, and every released table position (pagedkv ``-1``) is one
vLLM's rule releases (its null block), after every step. The released positions
of a refused allocation (the preemption signal) are compared before the request is freed: both
managers release out-of-window blocks first and keep them released. A schedule stops, without
failing, at the explained divergence: from the step where vLLM indexes two copies of one content
(pagedkv keeps one), the pools may differ block for block.

Needs vLLM 0.33's block manager importable (the vLLM venv of scripts/vllm/env.sh); skipped
otherwise; the test command runs it in its vLLM stage (scripts/vllm/stage.sh). The results of
the full per-chunk run are in benches/results/2026-12-06-vllm-per-chunk-differential.md ("Full
attention + sliding windows").
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest


def _vllm_available() -> bool:
    try:
        import torch  # noqa: F401
        from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: F401
        from vllm.v1.kv_cache_interface import SlidingWindowSpec  # noqa: F401
    except Exception:  # noqa: BLE001 (a broken partial install skips as well)
        return False
    return True


CASES = [
    "window-1-block",
    "window-6",
    "window-10-tiny-pool",
    "block16-window40",
    "block16-window512",
    "two-windows",
    "large-pool-window7",
    "async-window6",
    "spec-window10",
]


def test_script_imports_without_vllm(load_bench: Callable[[str], ModuleType]) -> None:
    """The script's module-level code needs only pagedkv: CI can import it."""
    module = load_bench("vllm_hybrid_differential")
    assert set(module.CONFIGS) == set(CASES)
    # every configuration is hybrid: one full-attention group first, then windows, one of
    # them exactly a block, some not a multiple of the block size
    windows = [(c.windows, c.block_size) for c in module.CONFIGS.values()]
    assert all(w[0] is None and len(w) >= 2 for w, _ in windows)
    assert any(w[1] == bs for w, bs in windows)
    assert any(x % bs for w, bs in windows for x in w[1:])
    assert {6, 10, 40, 512} <= {x for w, _ in windows for x in w[1:]}
    assert any(len(w) > 2 for w, _ in windows)


@pytest.mark.skipif(
    not _vllm_available(),
    reason="vLLM 0.33's KVCacheManager (and torch) not importable: "
    "runs in the vLLM stage (scripts/vllm/stage.sh)",
)
@pytest.mark.parametrize("config", CASES)
def test_hybrid_hits_and_blocks_in_use_equal_vllm(
    load_bench: Callable[[str], ModuleType], config: str
) -> None:
    module = load_bench("vllm_hybrid_differential")
    outcomes = [module.run_schedule(seed, module.CONFIGS[config]) for seed in range(5)]
    mismatches = [m for o in outcomes for m in o.mismatches]
    assert mismatches == []
    # the schedules exercise what they claim: hits, released window positions, and on the
    # small pools refusals or preemptions, before any stop
    assert sum(o.hits for o in outcomes) > 0
    assert sum(o.released_positions for o in outcomes) > 0
    cfg = module.CONFIGS[config]
    if cfg.num_blocks < 1000:
        assert sum(o.ooms + o.preemptions for o in outcomes) > 0
    if cfg.async_ids:
        assert sum(o.async_ids for o in outcomes) > 0
    if cfg.max_drafts:
        assert sum(o.rejected for o in outcomes) > 0
