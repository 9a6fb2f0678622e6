"""Argument checks of the cache operations (write_kv, copy_blocks, swap_blocks), shared by every
backend; they run before any launch.

The array checks they build on (dtype, rank, C-contiguity, alignment, writability) are the
attention calls' (``validation.py``). A failure raises ``InvalidArgumentError`` and nothing is
launched: slots and block ids are checked against the caches, so no input can make a kernel
write out of bounds.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedkv.attention import validation as val
from pagedkv.errors import InvalidArgumentError
from pagedkv.kernels import instances


def _check_cache_pair(names: tuple[str, str], k_cache: Any, v_cache: Any, backend: str) -> str:
    for name, x in zip(names, (k_cache, v_cache), strict=True):
        val._require_array(name, x, backend)
        if x.ndim != 4:
            raise InvalidArgumentError(
                f"{name} must be [num_blocks, block_size, num_kv_heads, head_dim], got shape {tuple(x.shape)}"
            )
        val._require_contiguous(name, x)
    if tuple(k_cache.shape) != tuple(v_cache.shape) or k_cache.dtype != v_cache.dtype:
        raise InvalidArgumentError(f"{names[0]} and {names[1]} must have one shape and dtype")
    kind = val._kind(names[0], k_cache, backend)
    if backend != "numpy":
        row_bytes = int(k_cache.shape[2]) * int(k_cache.shape[3]) * k_cache.dtype.itemsize
        if int(k_cache.shape[3]) not in instances.HEAD_DIMS:
            raise InvalidArgumentError(
                f"head_dim {int(k_cache.shape[3])} has no compiled kernel (supported: {instances.HEAD_DIMS})"
            )
        if row_bytes % 16:
            raise InvalidArgumentError("a slot's keys must fill whole 16-byte vectors")
        for name, x in zip(names, (k_cache, v_cache), strict=True):
            val._require_aligned(name, x)
    return kind


def check_write_kv(k: Any, v: Any, k_cache: Any, v_cache: Any, slot_mapping: Any, backend: str) -> str:
    """Validates a write_kv call; returns the KV kind. Slots must be distinct; -1 skips a token."""
    val.check_backend(backend)
    kind = _check_cache_pair(("k_cache", "v_cache"), k_cache, v_cache, backend)
    val._require_writable("k_cache", k_cache)
    val._require_writable("v_cache", v_cache)
    for name, x in (("k", k), ("v", v)):
        val._require_array(name, x, backend)
        if x.ndim != 3 or tuple(x.shape[1:]) != tuple(k_cache.shape[2:]):
            raise InvalidArgumentError(
                f"{name} must be [num_tokens, {int(k_cache.shape[2])}, {int(k_cache.shape[3])}], "
                f"got shape {tuple(x.shape)}"
            )
        if x.dtype != k_cache.dtype:
            raise InvalidArgumentError(f"{name} dtype {x.dtype} != cache dtype {k_cache.dtype}")
        val._require_contiguous(name, x)
        if backend != "numpy":
            val._require_aligned(name, x)
    if tuple(v.shape) != tuple(k.shape):
        raise InvalidArgumentError(f"v shape {tuple(v.shape)} != k shape {tuple(k.shape)}")
    val._require_array("slot_mapping", slot_mapping, backend)
    val._require_int("slot_mapping", slot_mapping, np.int64, 1)
    if int(slot_mapping.shape[0]) != int(k.shape[0]):
        raise InvalidArgumentError(
            f"slot_mapping has {int(slot_mapping.shape[0])} entries for {int(k.shape[0])} tokens"
        )
    if int(k.shape[0]) > 2**31 - 1:
        raise InvalidArgumentError("too many tokens for one launch")
    num_slots = int(k_cache.shape[0]) * int(k_cache.shape[1])
    if int(slot_mapping.shape[0]):
        if val._int(slot_mapping.min()) < -1 or val._int(slot_mapping.max()) >= num_slots:
            raise InvalidArgumentError(
                f"slot_mapping entries must lie in [-1, {num_slots}) (-1 skips a token)"
            )
        xp = val._xp(slot_mapping)
        real = slot_mapping[slot_mapping >= 0]
        if int(xp.unique(real).shape[0]) != int(real.shape[0]):
            raise InvalidArgumentError("slot_mapping names one slot twice")
    return kind


def check_copy_blocks(k_caches: Any, v_caches: Any, copy_ops: Any, backend: str) -> tuple[str, np.ndarray]:
    """Validates a copy_blocks call over every layer; returns the KV kind and copy_ops on the host
    (copy_ops may be a NumPy or, for backend='cuda', a CuPy array)."""
    val.check_backend(backend)
    if not isinstance(k_caches, (list, tuple)) or not isinstance(v_caches, (list, tuple)):
        raise InvalidArgumentError("k_caches and v_caches must be lists (one cache per layer)")
    if len(k_caches) == 0 or len(k_caches) != len(v_caches):
        raise InvalidArgumentError(
            f"k_caches ({len(k_caches)}) and v_caches ({len(v_caches)}) "
            "must list the same layers, at least one"
        )
    kind = ""
    for layer, (k, v) in enumerate(zip(k_caches, v_caches, strict=True)):
        kind = _check_cache_pair((f"k_caches[{layer}]", f"v_caches[{layer}]"), k, v, backend)
        val._require_writable(f"k_caches[{layer}]", k)
        val._require_writable(f"v_caches[{layer}]", v)
        if tuple(k.shape) != tuple(k_caches[0].shape) or k.dtype != k_caches[0].dtype:
            raise InvalidArgumentError(f"layer {layer}'s caches differ in shape or dtype from layer 0's")
    if len(k_caches) > 65535:
        raise InvalidArgumentError("at most 65535 layers per launch")
    return kind, check_copy_ops(copy_ops, backend, int(k_caches[0].shape[0]))


def check_copy_ops(copy_ops: Any, backend: str, num_blocks: int) -> np.ndarray:
    """copy_ops of a copy_blocks call over caches of `num_blocks` blocks, plain or quantized: an
    int32 [N, 2] array of (src, dst) block ids in range, returned on the host (with
    backend='cuda' it may be a CuPy array)."""
    if backend == "cuda" and val.is_cupy_array(copy_ops):
        copy_ops = copy_ops.get()
    if not isinstance(copy_ops, np.ndarray):
        raise InvalidArgumentError(f"copy_ops must be an int32 [N, 2] array, got {type(copy_ops).__name__}")
    if copy_ops.ndim != 2 or int(copy_ops.shape[1]) != 2:
        raise InvalidArgumentError(f"copy_ops must be [N, 2] (src, dst), got shape {tuple(copy_ops.shape)}")
    val._require_int("copy_ops", copy_ops, np.int32, 2)
    if int(copy_ops.shape[0]) and (val._int(copy_ops.min()) < 0 or val._int(copy_ops.max()) >= num_blocks):
        raise InvalidArgumentError(f"copy_ops block ids must lie in [0, {num_blocks})")
    return copy_ops


def check_swap_blocks(src_cache: Any, dst_cache: Any, mapping: Any, backend: str) -> str:
    """Validates a swap_blocks call; returns the KV kind. With backend='cuda' either cache may be a
    CuPy array or a NumPy array in pinned host memory (not both NumPy)."""
    return _check_swap(src_cache, dst_cache, mapping, backend, ndim=4)


def check_swap_bytes(src: Any, dst: Any, mapping: Any, backend: str) -> None:
    """``check_swap_blocks`` for two uint8 ``[num_blocks, block_bytes]`` arrays (the blocks of two
    quantized caches): the same checks but on byte rows instead of a KV dtype."""
    _check_swap(src, dst, mapping, backend, ndim=2)


def _check_swap(src_cache: Any, dst_cache: Any, mapping: Any, backend: str, ndim: int) -> str:
    val.check_backend(backend)
    for name, x in (("src_cache", src_cache), ("dst_cache", dst_cache)):
        if backend == "cuda":
            if not (val.is_cupy_array(x) or isinstance(x, np.ndarray)):
                raise InvalidArgumentError(f"{name} must be a CuPy array or a pinned NumPy array")
        else:
            val._require_array(name, x, backend)
        if x.ndim != ndim:
            want = (
                "[num_blocks, block_size, num_kv_heads, head_dim]"
                if ndim == 4
                else "[num_blocks, block_bytes]"
            )
            raise InvalidArgumentError(f"{name} must be {want}, got shape {tuple(x.shape)}")
        val._require_contiguous(name, x)
    if backend == "cuda" and not (val.is_cupy_array(src_cache) or val.is_cupy_array(dst_cache)):
        raise InvalidArgumentError(
            "backend='cuda' swaps between device and host: one cache must be a CuPy array"
        )
    if tuple(src_cache.shape[1:]) != tuple(dst_cache.shape[1:]) or src_cache.dtype != dst_cache.dtype:
        raise InvalidArgumentError(
            f"src_cache {tuple(src_cache.shape)} {src_cache.dtype} and dst_cache {tuple(dst_cache.shape)} "
            f"{dst_cache.dtype} must have the same block shape and dtype"
        )
    kind = val._kind("src_cache", src_cache, backend) if ndim == 4 else "bytes"
    val._require_writable("dst_cache", dst_cache)
    if val.is_cupy_array(src_cache) == val.is_cupy_array(dst_cache):
        a0, b0 = val._data_address(src_cache), val._data_address(dst_cache)
        a1, b1 = a0 + int(src_cache.nbytes), b0 + int(dst_cache.nbytes)
        if a0 < b1 and b0 < a1:
            raise InvalidArgumentError("src_cache and dst_cache overlap in memory")
    if not isinstance(mapping, np.ndarray):
        if val.is_cupy_array(mapping):
            mapping = mapping.get()
        else:
            raise InvalidArgumentError("mapping must be an int32 [N, 2] array")
    if mapping.ndim != 2 or int(mapping.shape[1]) != 2:
        raise InvalidArgumentError(
            f"mapping must be [N, 2] (src_block, dst_block), got shape {tuple(mapping.shape)}"
        )
    val._require_int("mapping", mapping, np.int32, 2)
    if mapping.shape[0]:
        src, dst = mapping[:, 0], mapping[:, 1]
        if int(src.min()) < 0 or int(src.max()) >= int(src_cache.shape[0]):
            raise InvalidArgumentError(f"mapping source block ids must lie in [0, {int(src_cache.shape[0])})")
        if int(dst.min()) < 0 or int(dst.max()) >= int(dst_cache.shape[0]):
            raise InvalidArgumentError(
                f"mapping destination block ids must lie in [0, {int(dst_cache.shape[0])})"
            )
        if np.unique(dst).shape[0] != dst.shape[0]:
            raise InvalidArgumentError("mapping names one destination block twice")
    return kind
