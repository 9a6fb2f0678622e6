"""Differential conformance against vLLM v1's real ``KVCacheManager`` under chunked prefill.

Runs the core comparison of ``benches/vllm_chunked_prefix.py`` (see its docstring) on a few
seeded schedules per configuration, both managers allocating per scheduled chunk (pagedkv's
``add_sequence(..., reserve_prompt=False)`` + ``allocate_slots``, vLLM's own ``allocate_slots``),
with async ids, speculative drafts rolled back by the watermark, lookahead slots, a watermark
and preemption on a refused allocation: every admission's hit equals vLLM's
``get_computed_blocks`` hit and pagedkv's own ``match_prefix``, no hit covers a block whose
tokens were never scheduled, admissions, chunks and decode steps fit or fail on both sides
alike, and blocks in use, table lengths and ``num_computed_tokens`` agree after every step.
A schedule stops, without failing, at the explained divergence (vLLM indexes two copies of one
content, pagedkv keeps one; the script's docstring); everything up to there was compared.

Needs vLLM 0.33's block manager importable (the vLLM venv of scripts/vllm/env.sh); skipped
otherwise; the test command runs it in its vLLM stage (scripts/vllm/stage.sh). The results of
the full per-chunk run are in benches/results/2026-12-06-vllm-per-chunk-differential.md ("Full
attention").
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest


def _vllm_available() -> bool:
    try:
        import torch  # noqa: F401
        from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: F401
    except Exception:  # noqa: BLE001 (a broken partial install skips as well)
        return False
    return True


CASES = ["small-pool", "tiny-pool", "block16", "large-pool", "watermark", "async", "spec", "spec-lookahead"]


def test_script_imports_without_vllm(load_bench: Callable[[str], ModuleType]) -> None:
    """The script's module-level code needs only pagedkv: CI can import it."""
    module = load_bench("vllm_chunked_prefix")
    assert set(module.CONFIGS) == set(CASES)
    # per-chunk features each covered: async ids, drafts, lookahead slots, the watermark
    configs = module.CONFIGS.values()
    assert any(c.async_ids for c in configs) and any(c.max_drafts for c in configs)
    assert any(c.lookahead for c in configs) and any(c.watermark_blocks for c in configs)


@pytest.mark.skipif(
    not _vllm_available(),
    reason="vLLM 0.33's KVCacheManager (and torch) not importable: "
    "runs in the vLLM stage (scripts/vllm/stage.sh)",
)
@pytest.mark.parametrize("config", CASES)
def test_hits_and_blocks_in_use_equal_vllm(load_bench: Callable[[str], ModuleType], config: str) -> None:
    module = load_bench("vllm_chunked_prefix")
    outcomes = [module.run_schedule(seed, module.CONFIGS[config]) for seed in range(6)]
    mismatches = [m for o in outcomes for m in o.mismatches]
    assert mismatches == []
    # the schedules exercise what they claim: hits, and on the small pools refusals or
    # preemptions, before any stop
    assert sum(o.hits for o in outcomes) > 0
    cfg = module.CONFIGS[config]
    if config != "large-pool":
        assert sum(o.ooms + o.preemptions for o in outcomes) > 0
    if cfg.async_ids:
        assert sum(o.async_ids for o in outcomes) > 0
    if cfg.max_drafts:
        assert sum(o.rejected for o in outcomes) > 0 and sum(o.drafts for o in outcomes) > 0
