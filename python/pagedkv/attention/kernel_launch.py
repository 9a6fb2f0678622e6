"""Turns validated calls into kernel launches; shared by the ``cuda`` and ``emulated`` backends.

A runner supplies the array module (CuPy or NumPy), a ``launch(instance, grid, block, args)``
and a ``memcpy(dst_address, src_address, num_bytes)``; everything else (instances, grids,
arguments, split sizes, copy waves, swap runs) is decided here, once, for both backends, so the
emulated backend exercises exactly the launch arithmetic the GPU gets.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from pagedkv.attention import copy_planning, split_planning
from pagedkv.attention import validation as val
from pagedkv.attention.dtypes import nan_fill_value
from pagedkv.attention.window import kernel_window
from pagedkv.errors import InvalidArgumentError, InvariantViolation
from pagedkv.kernels import instances
from pagedkv.kernels.instances import Instance

LOG2E = 1.4426950408889634


class Runner(Protocol):
    xp: Any  # numpy or cupy
    poison: bool  # fill outputs with NaN before launches, so unwritten elements show
    num_sms: int

    def launch(
        self,
        instance: Instance,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[Any],
        reachable: Sequence[Any] = (),
    ) -> None: ...

    def memcpy(self, dst_address: int, src_address: int, num_bytes: int) -> None: ...

    def address(self, array: Any) -> int: ...

    def ctas_per_sm(self, instance: Instance) -> int: ...


def _output(runner: Runner, shape: tuple[int, ...], dtype: Any, fill: Any) -> Any:
    xp = runner.xp
    if runner.poison:
        return xp.full(shape, fill, dtype=dtype)
    return xp.empty(shape, dtype=dtype)


def choose_splits(
    num_ctas: int,
    max_seq_len: int,
    tile_tokens: int,
    num_sms: int,
    requested: int | None,
    max_splits: int = instances.MAX_SPLITS,
    ctas_per_sm: int = 2,
) -> tuple[int, int]:
    """(num_splits, tokens_per_split) for a decode grid of num_ctas CTAs per split: the split
    planner's choice (whole waves on num_sms x ctas_per_sm slots, chunks of at least
    split_planning.MIN_TOKENS_PER_SPLIT tokens), or ``requested`` capped at max_splits.
    tokens_per_split is a whole number of tiles."""
    plan = split_planning.plan_splits(
        num_ctas,
        max_seq_len,
        tile_tokens,
        num_sms,
        ctas_per_sm,
        requested,
        min(max_splits, instances.MAX_SPLITS),
    )
    return plan.num_splits, plan.tokens_per_split


def decode_instance(shape: val.AttentionShape) -> Instance:
    """The decode kernel instance that runs this call: by default tensor cores for fp16/bf16
    groups of 3..8 query heads per KV head (instances.uses_tensor_cores), CUDA cores otherwise;
    shape.use_tensor_cores (checked by validation.check_tensor_core_choice) overrides the rule."""
    return instances.decode_for(
        shape.kind, shape.head_dim, shape.block_size, shape.group, shape.use_tensor_cores
    )


def paged_attention(
    runner: Runner,
    q: Any,
    k_cache: Any,
    v_cache: Any,
    block_tables: Any,
    seq_lens: Any,
    shape: val.AttentionShape,
    num_splits: int | None = None,
    window: int | None = None,
) -> Any:
    """One decode call with its own output and split buffers (see DecodeWorkspace for a call with
    none). Host (NumPy) tables and lengths are uploaded; shape.max_seq_len comes from the host.
    window: sliding window (None: all keys); the splits cut only the visible keys."""
    out = _output(runner, tuple(q.shape), q.dtype, nan_fill_value(shape.kind))
    if shape.num_seqs == 0:
        return out
    tile = instances.tile_tokens(shape.kind, shape.head_dim)
    splits, tokens_per_split = choose_splits(
        shape.num_seqs * shape.num_kv_heads,
        split_planning.visible_tokens(shape.max_seq_len, window, tile),
        tile,
        runner.num_sms,
        num_splits,
        ctas_per_sm=runner.ctas_per_sm(decode_instance(shape)),
    )
    if splits > 1:
        part = (shape.num_seqs, shape.num_q_heads, splits)
        split_out = _output(runner, (*part, shape.head_dim), np.float32, np.nan)
        split_max = _output(runner, part, np.float32, np.nan)
        split_sum = _output(runner, part, np.float32, np.nan)
    else:  # unused by the kernel with one split
        split_out = split_max = split_sum = runner.xp.zeros(1, dtype=np.float32)
    if runner.xp is not np:
        block_tables, seq_lens = runner.xp.asarray(block_tables), runner.xp.asarray(seq_lens)
    launch_decode(
        runner,
        out,
        (split_out, split_max, split_sum),
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        shape,
        int(block_tables.shape[1]),
        splits,
        tokens_per_split,
        window,
    )
    return out


def check_decode_split(
    shape: val.AttentionShape, splits: int, tokens_per_split: int, window: int | None = None
) -> None:
    """Refuses a decode split the kernels would get wrong, before the launch (host arithmetic only,
    so it runs under graph capture too):

    - tokens_per_split a positive multiple of min(block_size, tile): the tensor-core kernel stages
      a tile's page-table entries assuming the tile starts at a block boundary (or at a tile
      boundary inside a longer block); a split starting elsewhere reads the wrong blocks and
      returns finite, wrong values (reproduced at head_dim 128, block 16, 40 tokens per split).
      The split planner only makes whole tiles, which always satisfy this.
    - 1 <= splits <= instances.MAX_SPLITS (the merge kernel's shared weights) and splits *
      tokens_per_split covering the keys the longest sequence shows (split_planning.visible_tokens):
      fewer would silently drop its last keys.
    """
    tile = instances.tile_tokens(shape.kind, shape.head_dim)
    align = min(shape.block_size, tile)
    if isinstance(tokens_per_split, bool) or tokens_per_split < 1 or tokens_per_split % align:
        raise InvalidArgumentError(
            f"tokens_per_split {tokens_per_split} must be a positive multiple of {align} "
            f"(min of block_size {shape.block_size} and the {tile}-token tile)"
        )
    if not 1 <= splits <= instances.MAX_SPLITS:
        raise InvalidArgumentError(f"num_splits {splits} must lie in [1, {instances.MAX_SPLITS}]")
    visible = split_planning.visible_tokens(shape.max_seq_len, window, tile)
    if splits * tokens_per_split < visible:
        raise InvalidArgumentError(
            f"{splits} splits of {tokens_per_split} tokens do not cover the {visible} keys of the longest "
            "sequence"
        )


def launch_decode(
    runner: Runner,
    out: Any,
    split_buffers: tuple[Any, Any, Any],
    q: Any,
    k_cache: Any,
    v_cache: Any,
    block_tables: Any,
    seq_lens: Any,
    shape: val.AttentionShape,
    table_stride: int,
    splits: int,
    tokens_per_split: int,
    window: int | None = None,
) -> None:
    """The decode launch (and the merge launch with more than one split): launches only, no
    allocation and no host access to device memory, so it may run under CUDA graph capture.

    block_tables: rows of table_stride int32 entries, the first num_seqs rows used;
    split_buffers: (split_out, split_max, split_sum) holding at least
    num_seqs * num_q_heads * splits * (head_dim, 1, 1) floats when splits > 1.
    window: sliding window (None: none), passed to the kernel as a runtime argument (0: none), so
    no instance is compiled per window; splits * tokens_per_split must cover the visible keys
    (split_planning.visible_tokens) and tokens_per_split be a multiple of min(block_size, tile):
    check_decode_split refuses anything else with InvalidArgumentError.
    """
    check_decode_split(shape, splits, tokens_per_split, window)
    split_out, split_max, split_sum = split_buffers
    instance = decode_instance(shape)
    runner.launch(
        instance,
        (shape.num_kv_heads, shape.num_seqs, splits),
        (instances.threads_per_cta(instance), 1, 1),
        [
            out,
            split_out,
            split_max,
            split_sum,
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            np.int32(shape.num_kv_heads),
            np.int32(shape.group),
            np.int32(table_stride),
            np.int32(tokens_per_split),
            np.float32(shape.scale * LOG2E),
            np.int32(kernel_window(window)),
        ],
    )
    if splits > 1:
        runner.launch(
            instances.merge(shape.kind, shape.head_dim),
            (shape.num_q_heads, shape.num_seqs, 1),
            (instances.MERGE_THREADS, 1, 1),
            [out, split_out, split_max, split_sum, np.int32(splits)],
        )


def contiguous_attention(runner: Runner, q: Any, k: Any, v: Any, shape: val.AttentionShape) -> Any:
    """One sequence through the paged kernel: k/v laid into a block-size-16 cache, table 0..n-1."""
    xp = runner.xp
    block_size = 16
    seq_len = int(k.shape[0])
    num_blocks = max(1, -(-seq_len // block_size))
    caches = []
    for x in (k, v):
        cache = xp.zeros((num_blocks * block_size, *x.shape[1:]), dtype=x.dtype)
        cache[:seq_len] = x
        caches.append(cache.reshape(num_blocks, block_size, *x.shape[1:]))
    table = xp.arange(num_blocks, dtype=np.int32).reshape(1, num_blocks)
    lens = xp.asarray(np.array([seq_len], dtype=np.int32))
    paged = val.AttentionShape(
        1,
        shape.num_q_heads,
        shape.num_kv_heads,
        shape.head_dim,
        block_size,
        num_blocks,
        num_blocks,
        shape.group,
        shape.kind,
        shape.scale,
        seq_len,
    )
    qb = xp.ascontiguousarray(q.reshape(1, *q.shape))
    return paged_attention(runner, qb, caches[0], caches[1], table, lens, paged)[0]


def write_kv(
    runner: Runner, k: Any, v: Any, k_cache: Any, v_cache: Any, slot_mapping: Any, kind: str
) -> None:
    num_tokens = int(k.shape[0])
    if num_tokens == 0:
        return
    runner.launch(
        instances.write_kv(kind, int(k_cache.shape[3])),
        (num_tokens, 1, 1),
        (instances.COPY_THREADS, 1, 1),
        [k_cache, v_cache, k, v, slot_mapping, np.int32(int(k_cache.shape[2]))],
    )


def copy_blocks(
    runner: Runner, k_caches: Sequence[Any], v_caches: Sequence[Any], copy_ops: np.ndarray
) -> int:
    """Runs every layer's copies; returns the number of launches (hazard-free waves)."""
    xp = runner.xp
    waves = copy_planning.copy_waves(copy_ops)
    if not waves:
        return 0
    addresses = xp.asarray(np.array([runner.address(c) for c in (*k_caches, *v_caches)], dtype=np.int64))
    block_bytes = int(k_caches[0][0].nbytes) if int(k_caches[0].shape[0]) else 0
    for wave in waves:
        runner.launch(
            instances.copy_blocks(),
            (int(wave.shape[0]), len(k_caches), 2),
            (instances.COPY_THREADS, 1, 1),
            [addresses, xp.asarray(wave), np.int64(block_bytes // 16)],
            reachable=[*k_caches, *v_caches],
        )
    return len(waves)


def swap_blocks(runner: Runner, src_cache: Any, dst_cache: Any, mapping: Any) -> int:
    """One memcpy per run of adjacent blocks; returns the number of copies issued."""
    runs = copy_planning.merge_runs(mapping)
    block_bytes = int(src_cache.nbytes) // int(src_cache.shape[0]) if int(src_cache.shape[0]) else 0
    src_base, dst_base = runner.address(src_cache), runner.address(dst_cache)
    # The raw copies bypass the emulation harness's bounds check, so check every run here: a
    # validation gap must surface as an error, not as a copy outside the caches.
    src_blocks, dst_blocks = int(src_cache.shape[0]), int(dst_cache.shape[0])
    for src, dst, count in runs:
        if src < 0 or dst < 0 or src + count > src_blocks or dst + count > dst_blocks:
            raise InvariantViolation(f"swap run ({src}, {dst}, {count}) leaves the caches: a validation bug")
    for src, dst, count in runs:
        runner.memcpy(dst_base + dst * block_bytes, src_base + src * block_bytes, count * block_bytes)
    return len(runs)
