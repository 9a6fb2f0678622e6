"""The memory section of ``pagedkv bench-engine``: KV bytes a model holds at long contexts with
hybrid KV groups (``EngineConfig(hybrid_kv=True)``: sliding-window layers release the blocks
their window has passed) against the same model with every layer's history kept
(``hybrid_kv=False``), and how many such sequences a fixed KV budget admits.

What it measures: the block accounting of the real ``KvCacheManager`` built exactly as the
engine builds it (the layout's ``kv_groups``, the engine's block size), driven the way the
engine's scheduler drives it, without the forward passes (an 8 K-token Gemma prefill is minutes
of NumPy compute; the forward pass through hybrid tables is tested on its own,
tests/engine/test_hybrid_engine.py). A sequence at context C is a prompt of C - 1 distinct tokens
admitted with ``add_sequence(..., num_scheduled=chunk)`` and computed in chunks
(``advance_computed``), then its first generated token appended (``append_tokens``, the decode
step that computes position C - 1): the window release runs at each of those steps, as in the
engine. Bytes in use are ``stats()["num_blocks_in_use"]`` times the bytes one block holds in
the store's caches (``KvLayout.bytes_per_block``: K and V of the layers of one group, fp32).
The admitted batch fills a pool of ``budget // bytes_per_block`` blocks with such sequences one
after another while the prompt's blocks in every group fit the free blocks (the scheduler's
admission rule, without its watermark); the admission peak (every group holds the
whole prompt until it is computed) is what limits the last one.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import pagedkv
from pagedkv.engine.kv_layout import KvLayout, kv_layout, layer_windows, new_manager
from pagedkv.errors import InvalidArgumentError, OutOfBlocksError

__all__ = ["DEFAULT_BUDGET_BYTES", "DEFAULT_CONTEXTS", "kv_memory"]

DEFAULT_CONTEXTS = (2048, 8192)
DEFAULT_BUDGET_BYTES = 2 << 30  # 2 GiB of K/V (fp32 caches)
PREFILL_CHUNK = 512  # tokens per prefill step (the engine's max_num_batched_tokens in the bench)
MAX_BATCH = 4096  # a bound on the admission loop (a budget admitting more: "batch_capped")


def _manager(layout: KvLayout, num_blocks: int, block_size: int) -> pagedkv.KvCacheManager:
    manager: pagedkv.KvCacheManager = new_manager(layout, num_blocks=num_blocks, block_size=block_size)
    return manager


def _add_at_context(kv: pagedkv.KvCacheManager, seq_id: int, context: int, vocab: int) -> None:
    """A sequence whose context is ``context`` tokens in decode (see the module docstring)."""
    rng = np.random.default_rng(seq_id)
    prompt = rng.integers(0, vocab, size=context - 1, dtype=np.int64)
    kv.add_sequence(seq_id, prompt, num_scheduled=min(PREFILL_CHUNK, len(prompt)))
    while kv.num_computed_tokens(seq_id) < len(prompt):
        kv.advance_computed([seq_id], min(PREFILL_CHUNK, len(prompt) - kv.num_computed_tokens(seq_id)))
    kv.append_tokens(seq_id, np.array([1], np.int64))


def _blocks_in_use(kv: pagedkv.KvCacheManager) -> int:
    return int(kv.stats()["num_blocks_in_use"])


def _one_layout(
    layout: KvLayout, config: Any, contexts: tuple[int, ...], block_size: int, budget: int
) -> dict[str, Any]:
    per_block = layout.bytes_per_block(block_size, config.num_kv_heads, config.head_dim)
    out: dict[str, Any] = {
        "kv_groups": ["full" if w is None else f"window {w}" for w in layout.group_windows],
        "layers_per_group": layout.layers_per_group,
        "bytes_per_block": per_block,
        "contexts": {},
    }
    for context in contexts:
        blocks_per_group = -(-context // block_size)
        kv = _manager(layout, layout.num_groups * blocks_per_group + 1, block_size)
        _add_at_context(kv, 0, context, config.vocab_size)
        kv.check_invariants()
        in_use = _blocks_in_use(kv)
        pool = budget // per_block
        if pool < 1:
            raise InvalidArgumentError(f"a KV budget of {budget} bytes holds no block of {per_block} bytes")
        batch = _kv_budget_batch(layout, pool, block_size, context, config.vocab_size)
        out["contexts"][str(context)] = {
            "blocks_in_use": in_use,
            "kv_bytes_in_use": in_use * per_block,
            "budget_blocks": pool,
            "batch_admitted": batch,
            "batch_capped": batch >= MAX_BATCH,  # the loop stopped at MAX_BATCH, not the budget
        }
    return out


def _kv_budget_batch(layout: KvLayout, pool: int, block_size: int, context: int, vocab: int) -> int:
    kv = _manager(layout, pool, block_size)
    admitted = 0
    prompt_blocks = layout.num_groups * -(-(context - 1) // block_size)  # the scheduler's rule
    while admitted < MAX_BATCH and prompt_blocks <= kv.num_free_blocks:
        try:
            _add_at_context(kv, admitted, context, vocab)
        except OutOfBlocksError:
            break  # the prompt fitted, its first token's block did not: not admitted
        admitted += 1
    kv.check_invariants()
    return admitted


def kv_memory(
    config: Any,
    *,
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS,
    block_size: int = 16,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
) -> dict[str, Any]:
    """KV bytes in use at each context and the batch a ``budget_bytes`` pool admits, hybrid
    groups against every layer full attention; ``ratio`` = hybrid bytes / all-full bytes."""
    for context in contexts:
        if (
            isinstance(context, bool)
            or not isinstance(context, int)
            or not 2 <= context <= config.max_model_len
        ):
            raise InvalidArgumentError(
                f"contexts must be integers in [2, {config.max_model_len}] (the model's context), "
                f"got {context!r}"
            )
    windows = layer_windows(config)
    hybrid = _one_layout(kv_layout(windows, hybrid=True), config, contexts, block_size, budget_bytes)
    full = _one_layout(kv_layout(windows, hybrid=False), config, contexts, block_size, budget_bytes)
    ratios = {
        c: hybrid["contexts"][c]["kv_bytes_in_use"] / full["contexts"][c]["kv_bytes_in_use"]
        for c in hybrid["contexts"]
    }
    return {
        "block_size": block_size,
        "budget_bytes": budget_bytes,
        "prefill_chunk": PREFILL_CHUNK,
        "hybrid": hybrid,
        "all_full": full,
        "ratio": ratios,
    }
