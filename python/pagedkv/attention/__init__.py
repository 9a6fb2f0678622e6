"""Paged attention and KV-cache data movement, with three interchangeable backends.

Every function takes ``backend=``:

- ``"numpy"``: the NumPy reference (fp16, bf16, fp32, fp64).
- ``"cuda"``: the CUDA kernels in ``pagedkv/kernels/*.cu`` through CuPy (CuPy arrays in and out).
- ``"emulated"``: the very same ``.cu`` sources compiled for the CPU with ``cuda_emu.h`` and run on
  NumPy arrays, so the real kernel code is tested on machines without a GPU.
- ``"cpu"``: the Rust CPU data plane (``pagedkv.attention.cpu_backend``; fp32, fp16, bf16; threads
  and SIMD; within a stated tolerance of the reference, docs/cpu_data_plane.md).

Quantized caches: wherever a cache goes, a ``QuantizedKvCache`` (kv_cache_dtype "int8", "fp8_e4m3"
or "int4"; docs/quantized_kv.md) may go instead, on the numpy, cuda and emulated backends
(backend='cpu' raises InvalidArgumentError naming the dtype). Writes quantize, attention
dequantizes; int4 caches also take ``residual_slots`` (each sequence's int8 residual slot).

Layouts (docs/design.md, KV layouts): caches ``[num_blocks, block_size, num_kv_heads, head_dim]``;
decode query ``[num_seqs, num_q_heads, head_dim]`` with ``num_q_heads % num_kv_heads == 0``; query
head h reads KV head ``h // (num_q_heads // num_kv_heads)``. bfloat16 tensors are uint16 arrays of bit
patterns.
Bad arguments raise ``pagedkv.InvalidArgumentError`` before anything runs.
"""

import dataclasses
from typing import Any

import numpy as np

from pagedkv.attention import cache_op_validation as cval
from pagedkv.attention import (
    cpu_backend,
    cpu_quant_backend,
    kernel_launch,
    quant_launch,
    quant_reference,
    reference,
)
from pagedkv.attention import quant_validation as qval
from pagedkv.attention import validation as val
from pagedkv.attention.kv_cache_dtype import (
    KV_CACHE_DTYPES,
    block_bytes,
    blocks_for_memory,
    kv_block_bytes,
    residual_bytes,
    sequences_for_memory,
)
from pagedkv.attention.prefill import paged_prefill_attention
from pagedkv.attention.quantized_cache import QuantizedKvCache
from pagedkv.attention.runners import CudaRunner, get_runner
from pagedkv.attention.window import check_window
from pagedkv.attention.workspace import DecodePlan, DecodeWorkspace
from pagedkv.errors import InvalidArgumentError

__all__ = [
    "contiguous_attention",
    "paged_attention",
    "paged_prefill_attention",
    "write_kv",
    "copy_blocks",
    "swap_blocks",
    "DecodeWorkspace",
    "DecodePlan",
    "QuantizedKvCache",
    "KV_CACHE_DTYPES",
    "block_bytes",
    "blocks_for_memory",
    "kv_block_bytes",
    "residual_bytes",
    "sequences_for_memory",
]


def contiguous_attention(
    q: Any, k: Any, v: Any, *, scale: float | None = None, backend: str = "numpy"
) -> Any:
    """Attention of one query token over one sequence's contiguous history (the reference).

    q: [num_q_heads, head_dim]; k, v: [seq_len, num_kv_heads, head_dim], one dtype.
    Returns [num_q_heads, head_dim] in q's dtype; zeros when seq_len == 0.
    scale defaults to 1 / sqrt(head_dim).
    """
    q, k, v = (val.unwrap_ndarray_subclass(n, x) for n, x in (("q", q), ("k", k), ("v", v)))
    if backend == "cpu":
        return _cpu_contiguous_attention(q, k, v, scale)
    if val.check_backend(backend) == "numpy":
        return reference.contiguous_attention(q, k, v, scale)
    shape = val.check_contiguous_attention(q, k, v, scale, backend)
    return kernel_launch.contiguous_attention(get_runner(backend), q, k, v, shape)


def paged_attention(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    block_tables: Any,
    seq_lens: Any,
    *,
    scale: float | None = None,
    backend: str = "numpy",
    num_splits: int | None = None,
    use_tensor_cores: bool | None = None,
    window: int | None = None,
    residual_slots: Any = None,
) -> Any:
    """Decode attention: each sequence's query token over its paged history.

    q: [num_seqs, num_q_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads,
    head_dim]; block_tables: int32 [num_seqs, max_blocks] (entries past a sequence's
    ceil(seq_len / block_size) blocks are ignored, e.g. -1 padding); seq_lens: int32 [num_seqs].
    backend='cuda': pass block_tables and seq_lens as NumPy arrays (the host metadata, e.g. from
    KvCacheManager.batch_block_tables) and the call checks them on the host and never waits for
    the GPU; CuPy tables and lengths are checked on the device, which costs device-to-host syncs.
    For decode steps with no allocation (CUDA graph capture) use DecodeWorkspace.
    Returns [num_seqs, num_q_heads, head_dim] in q's dtype.
    num_splits (kernel backends): split each sequence's tokens over this many blocks and merge
    (default: chosen from the device's size and the longest sequence).
    use_tensor_cores (kernel backends): None (default) runs the tensor-core kernel for fp16/bf16
    caches with 3..8 query heads per KV head and the CUDA-core kernel otherwise; True requires the
    tensor-core kernel (InvalidArgumentError where it cannot run: fp32, other group sizes, head
    sizes outside 64/128/256); False always runs the CUDA-core kernel (e.g. to A/B the two).
    Checked (True, False or None; NumPy bools accepted) on every backend; the NumPy reference
    ignores it.
    window: sliding-window attention, inclusive as in Gemma / Hugging Face: the query (at position
    seq_len - 1) sees the keys at positions [seq_len - window, seq_len - 1], i.e. the last
    ``window`` keys (None: all). Blocks wholly before the window are never read and their table
    entries may be -1 (released by a sliding-window KV group): the kernels start each
    sequence's key loop at the window (docs/decode_kernel.md) and plan splits over it.
    Quantized caches (``QuantizedKvCache``, every backend): keys and values are dequantized as
    they are read; tables and lengths are host (NumPy) arrays on every backend;
    use_tensor_cores=True is refused (no tensor-core kernel for them). residual_slots (int4
    only): int32 [num_seqs], each sequence's residual slot (read where its last block is open:
    seq_len % block_size != 0).
    """
    q, k_cache, v_cache, block_tables, seq_lens = (
        val.unwrap_ndarray_subclass(n, x)
        for n, x in (
            ("q", q),
            ("k_cache", k_cache),
            ("v_cache", v_cache),
            ("block_tables", block_tables),
            ("seq_lens", seq_lens),
        )
    )
    splits = val.check_num_splits(num_splits)  # checked on every backend, used by the kernels
    tensor_cores = val.check_use_tensor_cores(use_tensor_cores)  # likewise
    window = check_window(window, val.check_backend(backend))
    if qval.is_quantized(k_cache, v_cache):
        return _quant_paged_attention(
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            scale,
            backend,
            splits,
            tensor_cores,
            window,
            residual_slots,
        )
    if residual_slots is not None:
        raise InvalidArgumentError("residual_slots is for int4 caches (QuantizedKvCache)")
    if backend == "cpu":
        return cpu_backend.paged_attention(
            q, k_cache, v_cache, block_tables, seq_lens, scale=scale, window=window
        )
    if backend == "numpy":
        return reference.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, window)
    shape = val.check_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, backend, window)
    val.check_tensor_core_choice(tensor_cores, shape.kind, shape.head_dim, shape.group)
    shape = dataclasses.replace(shape, use_tensor_cores=tensor_cores)
    return kernel_launch.paged_attention(
        get_runner(backend),
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        shape,
        splits,
        window,
    )


def write_kv(
    k: Any,
    v: Any,
    k_cache: Any,
    v_cache: Any,
    slot_mapping: Any,
    *,
    backend: str = "numpy",
    residual_slots: Any = None,
) -> None:
    """Writes new tokens' keys and values into their cache slots, in place.

    k, v: [num_tokens, num_kv_heads, head_dim]; slot_mapping: int64 [num_tokens], slot =
    block_id * block_size + offset, -1 skips a token; slots must be distinct.
    Quantized caches quantize the tokens on the way in (slot_mapping may then be a NumPy array
    on every backend). int4: residual_slots int32 [num_tokens], the residual slot of each token's
    sequence; a block the write fills is sealed (quantized whole, its earlier tokens read from
    that slot), a block it leaves open keeps the tokens in the slot (docs/quantized_kv.md).
    """
    k, v, k_cache, v_cache, slot_mapping = (
        val.unwrap_ndarray_subclass(n, x)
        for n, x in (
            ("k", k),
            ("v", v),
            ("k_cache", k_cache),
            ("v_cache", v_cache),
            ("slot_mapping", slot_mapping),
        )
    )
    if qval.is_quantized(k_cache, v_cache):
        _quant_write_kv(k, v, k_cache, v_cache, slot_mapping, backend, residual_slots)
        return
    if residual_slots is not None:
        raise InvalidArgumentError("residual_slots is for int4 caches (QuantizedKvCache)")
    if backend == "cpu":
        cpu_backend.write_kv(k, v, k_cache, v_cache, slot_mapping)
        return
    if val.check_backend(backend) == "numpy":
        reference.write_kv(k, v, k_cache, v_cache, slot_mapping)
        return
    kind = cval.check_write_kv(k, v, k_cache, v_cache, slot_mapping, backend)
    kernel_launch.write_kv(get_runner(backend), k, v, k_cache, v_cache, slot_mapping, kind)


def copy_blocks(k_caches: Any, v_caches: Any, copy_ops: Any, *, backend: str = "numpy") -> None:
    """Executes copy-on-write copies in every layer: block src's contents onto block dst.

    k_caches, v_caches: lists over layers of [num_blocks, block_size, num_kv_heads, head_dim];
    copy_ops: int32 [N, 2] (src, dst), e.g. KvCacheManager.take_copy_ops(). The copies take effect
    as if run one after another in order (kernel backends: one launch for all layers, more only
    when a copy depends on an earlier one).
    """
    k_caches = val.unwrap_ndarray_subclasses("k_caches", k_caches)
    v_caches = val.unwrap_ndarray_subclasses("v_caches", v_caches)
    copy_ops = val.unwrap_ndarray_subclass("copy_ops", copy_ops)
    if qval.is_quantized(k_caches, v_caches):
        if val.check_backend(backend) == "cpu":
            cpu_quant_backend.copy_blocks(k_caches, v_caches, copy_ops)
            return
        if backend == "numpy":
            quant_reference.copy_blocks(k_caches, v_caches, copy_ops)
            return
        pairs, ops = qval.check_quant_copy(k_caches, v_caches, copy_ops, backend)
        quant_launch.copy_blocks(get_runner(backend), pairs, ops)
        return
    if backend == "cpu":
        cpu_backend.copy_blocks(k_caches, v_caches, copy_ops)
        return
    if val.check_backend(backend) == "numpy":
        reference.copy_blocks(k_caches, v_caches, copy_ops)
        return
    _, ops = cval.check_copy_blocks(k_caches, v_caches, copy_ops, backend)
    kernel_launch.copy_blocks(get_runner(backend), k_caches, v_caches, ops)


def swap_blocks(src_cache: Any, dst_cache: Any, mapping: Any, *, backend: str = "numpy") -> int:
    """Copies blocks between two caches of one block shape (e.g. device <-> swap tier).

    src_cache, dst_cache: [num_blocks_src|dst, block_size, num_kv_heads, head_dim];
    mapping: int32 [N, 2] (src_block, dst_block), e.g. from KvCacheManager.swap_out/swap_in.
    Adjacent blocks (source and destination both consecutive) move in one copy; returns the number
    of copies issued. backend='cuda': one side is a CuPy array, the other a CuPy array or a NumPy
    array in pinned memory (cupyx.empty_pinned); copies are asynchronous on the current stream.
    """
    src_cache, dst_cache, mapping = (
        val.unwrap_ndarray_subclass(n, x)
        for n, x in (("src_cache", src_cache), ("dst_cache", dst_cache), ("mapping", mapping))
    )
    quantized = qval.is_quantized(src_cache, dst_cache)
    if quantized and val.check_backend(backend) == "cpu":
        return cpu_quant_backend.swap_blocks(src_cache, dst_cache, mapping)
    if backend == "cpu":
        return cpu_backend.swap_blocks(src_cache, dst_cache, mapping)
    if val.check_backend(backend) == "numpy":
        if quantized:
            return quant_reference.swap_blocks(src_cache, dst_cache, mapping)
        return reference.swap_blocks(src_cache, dst_cache, mapping)
    if quantized:
        qval.check_quant_swap(src_cache, dst_cache, mapping, backend)
    else:
        cval.check_swap_blocks(src_cache, dst_cache, mapping, backend)
    runner = get_runner(backend)
    if isinstance(runner, CudaRunner):
        for name, x in (("src_cache", src_cache), ("dst_cache", dst_cache)):
            array = x.data if quantized else x
            if isinstance(array, np.ndarray) and not runner.is_pinned(array):
                raise InvalidArgumentError(
                    f"{name} is pageable host memory: allocate it with cupyx.empty_pinned"
                )
    if quantized:
        return quant_launch.swap_blocks(runner, src_cache, dst_cache, mapping)
    return kernel_launch.swap_blocks(runner, src_cache, dst_cache, mapping)


def _quant_paged_attention(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    block_tables: Any,
    seq_lens: Any,
    scale: float | None,
    backend: str,
    splits: int | None,
    tensor_cores: bool | None,
    window: int | None,
    residual_slots: Any,
) -> Any:
    """paged_attention on QuantizedKvCache caches (the NumPy reference, the CPU data plane or the
    quantized kernel)."""
    if tensor_cores is True:
        raise InvalidArgumentError(
            "use_tensor_cores=True: quantized caches run the CUDA-core quantized kernel; pass None or False"
        )
    if backend == "numpy":
        return quant_reference.paged_attention(
            q, k_cache, v_cache, block_tables, seq_lens, scale, window, residual_slots
        )
    if backend == "cpu":
        return cpu_quant_backend.paged_attention(
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            scale=scale,
            window=window,
            residual_slots=residual_slots,
        )
    pair, shape, slots, lens = qval.check_quant_decode(
        q, k_cache, v_cache, block_tables, seq_lens, scale, backend, window, residual_slots
    )
    tables = block_tables.get() if val.is_cupy_array(block_tables) else block_tables
    return quant_launch.paged_attention(
        get_runner(backend), q, pair, tables, lens, shape, slots, splits, window
    )


def _quant_write_kv(
    k: Any, v: Any, k_cache: Any, v_cache: Any, slot_mapping: Any, backend: str, residual_slots: Any
) -> None:
    if val.check_backend(backend) == "cpu":
        cpu_quant_backend.write_kv(k, v, k_cache, v_cache, slot_mapping, residual_slots)
        return
    if backend == "numpy":
        quant_reference.write_kv(k, v, k_cache, v_cache, slot_mapping, residual_slots)
        return
    pair, kind, plan, mapping = qval.check_quant_write(
        k, v, k_cache, v_cache, slot_mapping, backend, residual_slots
    )
    quant_launch.write_kv(get_runner(backend), k, v, pair, mapping, kind, plan)


def _cpu_contiguous_attention(q: Any, k: Any, v: Any, scale: float | None) -> Any:
    """contiguous_attention on the CPU data plane: the history is one block of seq_len tokens."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, np.ndarray):
            raise InvalidArgumentError(f"{name}: backend='cpu' takes NumPy arrays, got {type(x).__name__}")
    if q.ndim != 2 or k.ndim != 3:
        raise InvalidArgumentError(
            f"q must be [num_q_heads, head_dim] and k [seq_len, num_kv_heads, head_dim], got "
            f"{tuple(q.shape)} and {tuple(k.shape)}"
        )
    seq_len = int(k.shape[0])
    if seq_len == 0:  # no block of size 0: an empty history attends to nothing (zeros)
        val.check_contiguous_attention(q, k, v, scale, backend="numpy")
        return np.zeros(q.shape, dtype=q.dtype)
    out = cpu_backend.paged_attention(
        q[None],
        cpu_backend.input_array(k)[None],  # read only: a cache of one block, aligned if need be
        cpu_backend.input_array(v)[None],
        np.zeros((1, 1), np.int32),
        np.array([seq_len], np.int32),
        scale=scale,
    )
    return out[0]
