"""The memory section of ``pagedkv bench-engine``: KV bytes a model holds at long contexts with
hybrid KV groups (``EngineConfig(hybrid_kv=True)``: sliding-window layers release the blocks
their window has passed) against the same model with every layer's history kept
(``hybrid_kv=False``), and how many such sequences a fixed KV budget admits; then, per
``kv_cache_dtype`` (``EngineConfig(kv_cache_dtype=...)``, in the engine's default layout), how
many sequences the same budget admits, as a multiple of the float16 cache's
(``dtypes``: docs/quantized_kv.md).

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

Per dtype the pool is ``kv_budget.blocks_for_budget``'s: the budget less the residual slots of
the running sequences (int4: one 16-bit block of K and V per KV group and layer tensor, per
sequence, which the engine holds for ``max_num_seqs`` sequences), in blocks of the dtype's bytes
(codes and scales). For int4 the batch is the largest ``n`` whose pool, after ``n`` residual
slots, still admits ``n`` sequences (a binary search over the same admission replay).
"""

from __future__ import annotations

from typing import Any

import numpy as np

import pagedkv
from pagedkv.benchmarks.prefill_memory import chunked_prefill_memory
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.kv_budget import (
    ENGINE_KV_CACHE_DTYPES,
    blocks_for_budget,
    pool_block_bytes,
    residual_bytes_per_sequence,
)
from pagedkv.engine.kv_layout import KvLayout, kv_layout, layer_windows, new_manager
from pagedkv.errors import InvalidArgumentError, OutOfBlocksError

__all__ = ["DEFAULT_BUDGET_BYTES", "DEFAULT_CONTEXTS", "DEFAULT_DTYPES", "kv_memory"]

# The dtypes the section compares (float16 first: the baseline of the ratios).
DEFAULT_DTYPES = ("float16", "int8", "fp8_e4m3", "int4")

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


def _kv_budget_batch(
    layout: KvLayout, pool: int, block_size: int, context: int, vocab: int, cap: int = MAX_BATCH
) -> int:
    if pool < 1:
        return 0
    kv = _manager(layout, pool, block_size)
    admitted = 0
    prompt_blocks = layout.num_groups * -(-(context - 1) // block_size)  # the scheduler's rule
    while admitted < cap and prompt_blocks <= kv.num_free_blocks:
        try:
            _add_at_context(kv, admitted, context, vocab)
        except OutOfBlocksError:
            break  # the prompt fitted, its first token's block did not: not admitted
        admitted += 1
    kv.check_invariants()
    return admitted


def _dtype_batch(
    layout: KvLayout, config: Any, context: int, block_size: int, budget: int, dtype: str
) -> dict[str, Any]:
    """Sequences of ``context`` tokens a ``budget``-byte cache of ``dtype`` admits, its residual
    slots counted (module docstring)."""
    heads, dim = config.num_kv_heads, config.head_dim
    per_seq = residual_bytes_per_sequence(layout, block_size, heads, dim, dtype)

    def pool(slots: int) -> int:
        return blocks_for_budget(budget, layout, block_size, heads, dim, dtype, max_num_seqs=slots)

    vocab = config.vocab_size
    if not per_seq:
        slots = 0
        batch = _kv_budget_batch(layout, pool(0), block_size, context, vocab)
    else:
        lo, hi = 0, min(MAX_BATCH, budget // per_seq)  # the largest n admitted with n slots
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _kv_budget_batch(layout, pool(mid), block_size, context, vocab, cap=mid) >= mid:
                lo = mid
            else:
                hi = mid - 1
        slots = batch = lo
    return {
        "budget_blocks": pool(slots),
        "residual_slots": slots,
        "batch_admitted": batch,
        "batch_capped": batch >= MAX_BATCH,
    }


def _dtypes(
    config: Any, contexts: tuple[int, ...], block_size: int, budget: int, dtypes: tuple[str, ...]
) -> dict[str, Any]:
    """Per dtype: bytes per block and per sequence's residual, and per context the batch the
    budget admits and its ratio to the first dtype's (float16 by default)."""
    layout = kv_layout(layer_windows(config))
    heads, dim = config.num_kv_heads, config.head_dim
    out: dict[str, Any] = {}
    for dtype in dtypes:
        out[dtype] = {
            "bytes_per_block": pool_block_bytes(layout, block_size, heads, dim, dtype),
            "residual_bytes_per_sequence": residual_bytes_per_sequence(layout, block_size, heads, dim, dtype),
            "contexts": {
                str(c): _dtype_batch(layout, config, c, block_size, budget, dtype) for c in contexts
            },
        }
    base = out[dtypes[0]]["contexts"]
    for dtype in dtypes:
        for c, row in out[dtype]["contexts"].items():
            row[f"vs_{dtypes[0]}"] = (
                row["batch_admitted"] / base[c]["batch_admitted"] if base[c]["batch_admitted"] else None
            )
    return out


def kv_memory(
    config: Any,
    *,
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS,
    block_size: int = 16,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
    kv_cache_dtypes: tuple[str, ...] = DEFAULT_DTYPES,
) -> dict[str, Any]:
    """KV bytes in use at each context and the batch a ``budget_bytes`` pool admits, hybrid
    groups against every layer full attention (fp32 caches); ``ratio`` = hybrid bytes / all-full
    bytes; ``dtypes``: the batch per ``kv_cache_dtype`` and its ratio to the first one's;
    ``chunked_prefill``: the blocks held per KV group at every step of a chunked prefill
    (``prefill_memory.py``)."""
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
    if not kv_cache_dtypes or any(d not in ENGINE_KV_CACHE_DTYPES for d in kv_cache_dtypes):
        raise InvalidArgumentError(
            f"kv_cache_dtypes must name at least one of {ENGINE_KV_CACHE_DTYPES}, got {kv_cache_dtypes!r}"
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
        "dtypes": _dtypes(config, contexts, block_size, budget_bytes, tuple(kv_cache_dtypes)),
        # During the prefill, step by step, at the engine's default token budget per pass.
        "chunked_prefill": {
            str(c): chunked_prefill_memory(
                config, c, block_size=block_size, chunk=EngineConfig().max_num_batched_tokens
            )
            for c in contexts
        },
    }
