"""Kernel launches for quantized caches (``cuda`` and ``emulated`` backends share this code).

Attention (decode and prefill alike) runs ``paged_attention_quant_kernel`` over work tiles of
``instances.QUANT_ROWS`` packed (query token, head) rows: a decode call is a prefill call whose
sequences have one query each and a padded page table. More than one split per tile merges with
the decode kernels' ``merge_splits_kernel``, whose row layout ``[rows, num_q_heads, splits,
head_dim]`` the quantized kernel writes for decode and prefill rows alike.

Writes: 8-bit caches run ``quantize_kv_kernel``; int4 caches run ``seal_int4_kernel`` on the
blocks a write fills, then the int8 ``quantize_kv_kernel`` parks the tokens of blocks left open
in their residual slots, int8 blocks (stream order: the seal reads a residual slot before the
parking overwrites it). Copy and swap move blocks' bytes with the unquantized machinery.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedkv.attention import copy_planning, kernel_launch, prefill_launch
from pagedkv.attention import prefill_validation as pval
from pagedkv.attention import quant_validation as qval
from pagedkv.attention.dtypes import nan_fill_value
from pagedkv.attention.kernel_launch import LOG2E, Runner, _output
from pagedkv.attention.window import kernel_window
from pagedkv.errors import InvalidArgumentError
from pagedkv.kernels import instances

__all__ = ["copy_blocks", "paged_attention", "paged_prefill", "swap_blocks", "write_kv"]


def _i32(runner: Runner, x: np.ndarray) -> Any:
    return runner.xp.asarray(np.ascontiguousarray(x, dtype=np.int32))


def _residuals(runner: Runner, pair: qval.QuantPair) -> tuple[Any, Any]:
    """The int4 residual slots' bytes, or (for the 8-bit formats, which never read them) a
    one-byte stand-in."""
    if pair.k.residual is not None:
        return pair.k.residual.data, pair.v.residual.data
    dummy = runner.xp.zeros(1, dtype=np.uint8)
    return dummy, dummy


def _layout_args(pair: qval.QuantPair) -> list[Any]:
    """The blocks' layouts, then the residual slots' (int8, one for keys and values; zeros for
    the 8-bit formats)."""
    lk, lv = pair.layouts
    rl = pair.k.residual.layout if pair.k.residual is not None else None
    return [
        np.int64(lk.block_bytes),
        np.int64(lv.block_bytes),
        np.int64(lk.meta_offset),
        np.int64(lv.meta_offset),
        np.int64(lk.side_offset),
        np.int64(lv.side_offset),
        np.int64(0 if rl is None else rl.block_bytes),
        np.int64(0 if rl is None else rl.meta_offset),
    ]


def _attention(
    runner: Runner,
    q: Any,
    pair: qval.QuantPair,
    page_indices: np.ndarray,
    row_start: np.ndarray,
    seq_lens: np.ndarray,
    query_start_loc: np.ndarray,
    slots: np.ndarray | None,
    kind: str,
    group: int,
    scale: float,
    causal: bool,
    window: int | None,
    num_splits: int | None,
) -> Any:
    total_q, num_q_heads, head_dim = (int(s) for s in q.shape)
    num_kv_heads = pair.k.num_kv_heads
    out = _output(runner, (total_q, num_q_heads, head_dim), q.dtype, nan_fill_value(kind))
    rows = instances.QUANT_ROWS
    tile_seq, tile_row0 = prefill_launch.work_tiles(query_start_loc, group, rows)
    num_tiles = int(tile_seq.shape[0])
    if num_tiles == 0:
        return out
    kv_needed = prefill_launch.tile_kv_needed(
        query_start_loc, seq_lens, tile_seq, tile_row0, group, causal, window if causal else None, rows
    )
    tile = instances.quant_tile_tokens(head_dim)
    instance = instances.quant_attention(pair.kv_cache_dtype, kind, head_dim)
    splits, tokens_per_split = kernel_launch.choose_splits(
        num_tiles * num_kv_heads,
        max(1, int(kv_needed.max())),
        tile,
        runner.num_sms,
        num_splits,
        ctas_per_sm=runner.ctas_per_sm(instance),
    )
    if splits > 1:
        part = (total_q, num_q_heads, splits)
        split_out = _output(runner, (*part, head_dim), np.float32, np.nan)
        split_max = _output(runner, part, np.float32, np.nan)
        split_sum = _output(runner, part, np.float32, np.nan)
    else:  # unused by the kernel with one split
        split_out = split_max = split_sum = runner.xp.zeros(1, dtype=np.float32)
    k_res, v_res = _residuals(runner, pair)
    res_slots = slots if slots is not None else np.zeros(1, dtype=np.int32)
    runner.launch(
        instance,
        (num_tiles, num_kv_heads, splits),
        (instances.QUANT_THREADS, 1, 1),
        [
            out,
            split_out,
            split_max,
            split_sum,
            q,
            pair.k.data,
            pair.v.data,
            k_res,
            v_res,
            _i32(runner, page_indices),
            _i32(runner, row_start),
            _i32(runner, seq_lens),
            _i32(runner, query_start_loc),
            _i32(runner, res_slots),
            _i32(runner, tile_seq),
            _i32(runner, tile_row0),
            np.int32(num_kv_heads),
            np.int32(group),
            np.int32(pair.k.block_size),
            np.int32(1 if causal else 0),
            np.int32(tokens_per_split),
            np.float32(scale * LOG2E),
            np.int32(kernel_window(window) if causal else 0),
            *_layout_args(pair),
        ],
    )
    if splits > 1:
        runner.launch(
            instances.merge(kind, head_dim),
            (num_q_heads, total_q, 1),
            (instances.MERGE_THREADS, 1, 1),
            [out, split_out, split_max, split_sum, np.int32(splits)],
        )
    return out


def paged_attention(
    runner: Runner,
    q: Any,
    pair: qval.QuantPair,
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    shape: Any,
    slots: np.ndarray | None,
    num_splits: int | None,
    window: int | None,
) -> Any:
    """Decode: one query per sequence, the padded table's rows as the page table."""
    num_seqs, max_blocks = (int(s) for s in block_tables.shape)
    return _attention(
        runner,
        q,
        pair,
        np.ascontiguousarray(block_tables).reshape(-1),
        np.arange(num_seqs, dtype=np.int64) * max_blocks,
        seq_lens,
        np.arange(num_seqs + 1, dtype=np.int32),
        slots,
        shape.kind,
        shape.group,
        shape.scale,
        True,
        window,
        num_splits,
    )


def paged_prefill(
    runner: Runner,
    pair: qval.QuantPair,
    args: pval.PrefillArgs,
    slots: np.ndarray | None,
    num_splits: int | None,
    window: int | None,
) -> Any:
    shape = args.shape
    if int(args.table.row_start.max(initial=0)) > pval.MAX_KERNEL_ENTRIES:
        raise InvalidArgumentError("the page table has more entries than int32 offsets address")
    return _attention(
        runner,
        args.q,
        pair,
        args.table.indices,
        args.table.row_start,
        args.seq_lens,
        args.query_start_loc,
        slots,
        shape.kind,
        shape.group,
        shape.scale,
        shape.causal,
        window,
        num_splits,
    )


def write_kv(
    runner: Runner,
    k: Any,
    v: Any,
    pair: qval.QuantPair,
    slot_mapping: np.ndarray,
    kind: str,
    plan: qval.SealPlan | None,
) -> None:
    num_tokens, num_kv_heads, head_dim = (int(s) for s in k.shape)
    if num_tokens == 0:
        return
    lk, lv = pair.layouts
    if plan is None:  # 8-bit
        heads_per_cta = instances.QUANT_HEADS_PER_CTA
        runner.launch(
            instances.quantize_kv(pair.kv_cache_dtype, kind, head_dim),
            (num_tokens, -(-num_kv_heads // heads_per_cta), 2),
            (instances.QUANT_THREADS, 1, 1),
            [
                pair.k.data,
                pair.v.data,
                k,
                v,
                runner.xp.asarray(slot_mapping),
                np.int32(num_kv_heads),
                np.int32(pair.k.block_size),
                np.int64(lk.block_bytes),
                np.int64(lk.meta_offset),
            ],
        )
        return
    num_seals = int(plan.seal_blocks.shape[0])
    if num_seals:
        runner.launch(
            instances.seal_int4(kind, head_dim),
            (num_seals, num_kv_heads, 2),
            (instances.QUANT_THREADS, 1, 1),
            [
                pair.k.data,
                pair.v.data,
                k,
                v,
                pair.k.residual.data,
                pair.v.residual.data,
                _i32(runner, plan.seal_blocks),
                _i32(runner, plan.seal_residual),
                _i32(runner, plan.seal_rows),
                np.int32(num_kv_heads),
                np.int32(pair.k.block_size),
                *_layout_args(pair),
            ],
        )
    if bool((plan.residual_mapping >= 0).any()):
        rl = pair.k.residual.layout
        runner.launch(
            instances.quantize_kv(rl.kv_cache_dtype, kind, head_dim),
            (num_tokens, -(-num_kv_heads // instances.QUANT_HEADS_PER_CTA), 2),
            (instances.QUANT_THREADS, 1, 1),
            [
                pair.k.residual.data,
                pair.v.residual.data,
                k,
                v,
                runner.xp.asarray(plan.residual_mapping),
                np.int32(num_kv_heads),
                np.int32(pair.k.block_size),
                np.int64(rl.block_bytes),
                np.int64(rl.meta_offset),
            ],
        )


def copy_blocks(runner: Runner, pairs: list[qval.QuantPair], copy_ops: np.ndarray) -> int:
    """Every layer's block copies, keys and values (their blocks differ in size for int4: one
    launch per role and wave); returns the number of launches."""
    xp = runner.xp
    waves = copy_planning.copy_waves(copy_ops)
    launches = 0
    for role in ("k", "v"):
        caches = [getattr(p, role) for p in pairs]
        block_bytes = caches[0].layout.block_bytes
        addresses = xp.asarray(np.array([runner.address(c.data) for c in caches], dtype=np.int64))
        for wave in waves:
            runner.launch(
                instances.copy_blocks(),
                (int(wave.shape[0]), len(caches), 1),
                (instances.COPY_THREADS, 1, 1),
                [addresses, xp.asarray(wave), np.int64(block_bytes // 16)],
                reachable=[c.data for c in caches],
            )
            launches += 1
    return launches


def swap_blocks(runner: Runner, src_cache: Any, dst_cache: Any, mapping: np.ndarray) -> int:
    return kernel_launch.swap_blocks(runner, src_cache.data, dst_cache.data, mapping)
