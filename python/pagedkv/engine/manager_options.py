"""The block manager's options as the engine builds it: the pool, prefix caching, the host tiers,
and vLLM's per-chunk limits (docs/engine.md, "Per-chunk allocation").

The engine allocates blocks per scheduled chunk (``add_sequence(..., reserve_prompt=False)``,
then ``allocate_slots``), so the manager is told the limits vLLM's scheduler gives its
``KVCacheManager``: ``max_model_len``; the most tokens of one sequence a pass computes
(``max_pass_tokens``: a sliding-window group holds the ``window - 1`` tokens before a pass plus
the pass's own, the admission cap of each window group); and the admission watermark. One
function, so that the engine and a replay of its admission without the model (the memory
section of ``bench-engine``) build the same manager.
"""

from __future__ import annotations

from typing import Any

from pagedkv.engine.config import EngineConfig

__all__ = ["manager_options", "max_pass_tokens"]


def max_pass_tokens(config: EngineConfig, max_model_len: int) -> int:
    """The most tokens of one sequence a pass computes: a prefill chunk (at most the token
    budget) or a decode row with its drafts; without chunked prefill a whole prompt, up to the
    context."""
    if not config.enable_chunked_prefill:
        return max_model_len
    return min(max(config.max_num_batched_tokens, 1 + config.speculative_ngram), max_model_len)


def manager_options(config: EngineConfig, max_model_len: int) -> dict[str, Any]:
    """``KvCacheManager`` keywords (less ``kv_groups``, which ``kv_layout.new_manager`` adds, and
    the KV-event options) for an engine with this config and context. The admission watermark
    defaults to 1 % of the pool (at least one block); the scheduler applies it only while some
    sequence runs (``add_sequence(..., apply_watermark=...)``)."""
    c = config
    watermark = c.admission_watermark_blocks
    if watermark is None:
        watermark = max(1, c.pool_blocks // 100)
    return {
        "num_blocks": c.pool_blocks,
        "block_size": c.block_size,
        "enable_prefix_caching": c.enable_prefix_caching,
        "num_host_blocks": c.num_host_blocks,
        "num_host_cache_blocks": c.num_host_cache_blocks,
        "max_model_len": max_model_len,
        "max_in_flight_tokens": max_pass_tokens(c, max_model_len),
        "watermark_blocks": watermark,
    }
