"""``paged_prefill_attention``: many new query tokens per sequence through the paged cache.

One call covers a whole prompt with nothing cached, the uncached suffix of a prompt whose prefix
came from the prefix cache, one chunk of a chunked prefill, and a mixed batch whose rows are
prefills and decodes (a decode is a row with one query). docs/prefill.md states the semantics.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedkv.attention import cpu_backend, prefill_launch, prefill_reference, quant_launch, quant_reference
from pagedkv.attention import prefill_validation as pval
from pagedkv.attention import quant_validation as qval
from pagedkv.attention import validation as val
from pagedkv.attention.runners import get_runner
from pagedkv.attention.window import check_window
from pagedkv.errors import InvalidArgumentError


def paged_prefill_attention(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    block_tables: Any,
    seq_lens: Any,
    query_start_loc: Any,
    *,
    scale: float | None = None,
    causal: bool = True,
    backend: str = "numpy",
    num_splits: int | None = None,
    window: int | None = None,
    residual_slots: Any = None,
) -> Any:
    """Causal multi-query attention of each sequence's new tokens over its paged context.

    q: [total_q, num_q_heads, head_dim], the new tokens of all sequences concatenated;
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim];
    block_tables: int32 [B, max_blocks] (padded; entries past a sequence's blocks are ignored), or
    the CSR triple (kv_indptr int32 [B+1], kv_indices int32 [nnz], kv_last_page_len int32 [B]) of
    ``KvCacheManager.csr_page_table``;
    seq_lens: int32 [B], each sequence's whole context including its new tokens (their K/V already
    written with ``write_kv``); query_start_loc: int32 [B+1], cumulative query counts (vLLM's
    ``query_start_loc``, FlashInfer's ``qo_indptr``).

    Sequence i's queries are its last ``query_start_loc[i+1] - query_start_loc[i]`` positions. With
    ``causal`` the query at position p attends to keys 0..p, otherwise to every key. Query head h
    reads KV head ``h // (num_q_heads // num_kv_heads)``; scale defaults to 1 / sqrt(head_dim);
    accumulation in fp32 (fp64 for fp64). Returns [total_q, num_q_heads, head_dim] in q's dtype.

    Backends: ``numpy`` (every dtype, the reference); ``cpu`` (the Rust CPU data plane: fp32,
    fp16, bf16, every head size and block size); ``cuda`` and ``emulated`` run the tensor-core
    kernel ``kernels/paged_prefill.cu`` (fp16 and bf16, head_dim 64 or 128, block sizes 1/8/16/32;
    ``cuda`` takes CuPy tensors, the integer metadata may be NumPy or CuPy and is read on the host).
    num_splits (kernel backends): cut each work tile's keys into at most this many splits merged
    afterwards (split-KV); default: chosen from the device's size so that decode-heavy batches
    over long contexts still fill the GPU.
    window: sliding-window attention (needs ``causal``), inclusive as in Gemma / Hugging Face: the
    query at position p sees the keys at positions [p - window + 1, p], clipped at 0 (None: all of
    0..p). Blocks wholly before the window of a sequence's first query are never read and their
    table entries may be -1 (released by a sliding-window KV group): the kernel starts each work
    tile's key loop at its first row's window (docs/prefill.md).
    Quantized caches (``QuantizedKvCache``, docs/quantized_kv.md): numpy, cuda and emulated
    backends, every element type of q, head_dim 64/128/256 on the kernel backends;
    residual_slots (int4 only): int32 [B], each sequence's residual slot.
    """
    window = check_window(window, val.check_backend(backend))
    if qval.is_quantized(k_cache, v_cache):
        if backend == "cpu":
            qval.refuse_cpu(k_cache, v_cache)
        if backend == "numpy":
            return quant_reference.paged_prefill_attention(
                q,
                k_cache,
                v_cache,
                block_tables,
                seq_lens,
                query_start_loc,
                scale,
                causal,
                window,
                residual_slots,
            )
        pair, quant_args, slots = qval.check_quant_prefill(
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            scale,
            causal,
            backend,
            window,
            residual_slots,
        )
        splits = val.check_num_splits(num_splits)
        return quant_launch.paged_prefill(get_runner(backend), pair, quant_args, slots, splits, window)
    if residual_slots is not None:
        raise InvalidArgumentError("residual_slots is for int4 caches (QuantizedKvCache)")
    if backend == "cpu":
        return cpu_backend.paged_prefill_attention(
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            scale=scale,
            causal=causal,
            window=window,
        )
    if backend == "numpy":
        return prefill_reference.paged_prefill_attention(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, causal, window
        )
    args = pval.check_paged_prefill(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, causal, backend, window
    )
    if num_splits is not None and (
        isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer)) or num_splits < 1
    ):
        raise InvalidArgumentError(f"num_splits must be a positive integer, got {num_splits!r}")
    prefill_launch.check_kernel_shape(args.shape)
    return prefill_launch.paged_prefill(
        get_runner(backend), args, None if num_splits is None else int(num_splits), window
    )
