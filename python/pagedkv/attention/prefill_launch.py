"""Turns a validated ``paged_prefill_attention`` call into one kernel launch (``cuda`` and
``emulated`` backends share this code, so the emulation exercises the GPU's launch arithmetic).

The grid is a flat list of work tiles: sequence b's ``q_len * group`` packed (token, query head)
rows are cut into tiles of ``PREFILL_ROWS``, and every tile runs once per KV head. Rows with no
queries (``q_len == 0``) get no tile. The schedule is built on the host with NumPy (no Python loop
over sequences) and uploaded with the page table.

Work items (a tile, or one KV split of it) are dispatched longest first: the GPU hands out
blocks roughly in grid order, and under a causal mask a sequence's last tiles read the most keys,
so in row order the longest items would start last and leave the other SMs idle at the end of
the launch (longest-processing-time-first list scheduling, as FlashAttention walks causal query
blocks from the end).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedkv.attention import prefill_validation as pval
from pagedkv.attention.dtypes import nan_fill_value
from pagedkv.attention.kernel_launch import LOG2E, Runner, _output
from pagedkv.attention.window import first_visible_key, kernel_window
from pagedkv.errors import InvalidArgumentError
from pagedkv.kernels import instances

# Keys per split of a split-KV prefill: below this the merge launch and each CTA's fixed cost
# outweigh the keys it reads (prefill tiles are 64 query rows, so its floor sits above decode's).
MIN_TOKENS_PER_SPLIT = 256


def work_tiles(
    query_start_loc: np.ndarray, group: int, rows: int = instances.PREFILL_ROWS
) -> tuple[np.ndarray, np.ndarray]:
    """(tile_seq, tile_row0), int32 [num_tiles]: each tile's sequence and first packed row
    (``rows`` packed rows per tile: the prefill kernel's, or the quantized kernel's)."""
    q_lens = np.diff(query_start_loc.astype(np.int64))
    tiles = ((q_lens * group + rows - 1) // rows).astype(np.int64)
    total = int(tiles.sum())
    tile_seq = np.repeat(np.arange(q_lens.shape[0], dtype=np.int64), tiles)
    first = np.repeat(np.cumsum(tiles) - tiles, tiles)
    tile_row0 = (np.arange(total, dtype=np.int64) - first) * rows
    return tile_seq.astype(np.int32), tile_row0.astype(np.int32)


def check_kernel_shape(shape: pval.PrefillShape) -> None:
    """What the compiled prefill instances cover; anything else is refused before a launch."""
    if shape.kind not in instances.PREFILL_KINDS:
        raise InvalidArgumentError(
            f"the prefill kernel runs {instances.PREFILL_KINDS} (tensor cores), got {shape.kind}: "
            "use backend='numpy' for it"
        )
    if shape.head_dim not in instances.PREFILL_HEAD_DIMS:
        raise InvalidArgumentError(
            f"head_dim {shape.head_dim} has no compiled prefill kernel "
            f"(supported: {instances.PREFILL_HEAD_DIMS})"
        )
    if shape.block_size not in instances.BLOCK_SIZES:
        raise InvalidArgumentError(
            f"block_size {shape.block_size} has no compiled kernel (supported: {instances.BLOCK_SIZES})"
        )
    if shape.num_kv_heads > 65535:
        raise InvalidArgumentError(f"at most 65535 KV heads per launch, got {shape.num_kv_heads}")
    if shape.total_q * shape.num_q_heads > pval.MAX_KERNEL_ENTRIES:
        raise InvalidArgumentError("too many query rows x heads for one launch")


def tile_kv_needed(
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    tile_seq: np.ndarray,
    tile_row0: np.ndarray,
    group: int,
    causal: bool,
    window: int | None = None,
    rows: int = instances.PREFILL_ROWS,
) -> np.ndarray:
    """Keys each work tile reads (int64 [num_tiles]): all of its sequence's, or (causal) up to the
    position of the tile's last query row, and (causal, with a sliding window) from its first
    row's first visible key on; the kernel computes the same bounds."""
    seq = tile_seq.astype(np.int64)
    seq_len = seq_lens.astype(np.int64)[seq]
    if not causal:
        return seq_len
    q_len = np.diff(query_start_loc.astype(np.int64))[seq]
    first_pos = seq_len - q_len
    last_token = np.minimum(q_len - 1, (tile_row0.astype(np.int64) + rows - 1) // group)
    end = np.minimum(seq_len, first_pos + last_token + 1)
    if window is None:
        return end
    first_key = first_visible_key(first_pos + tile_row0.astype(np.int64) // group, window)
    return end - first_key


def choose_split_tokens(
    num_ctas: int, kv_needed: np.ndarray, kv_tile: int, num_sms: int, requested: int | None
) -> int:
    """Keys per split (a whole number of K/V tiles). Without a request: one split while the grid
    already gives every SM two blocks; otherwise enough splits for that, but none shorter than
    MIN_TOKENS_PER_SPLIT keys (the merge must stay cheap next to the attention)."""
    max_kv = int(kv_needed.max(initial=1))
    if requested is not None:
        splits = min(max(1, requested), instances.MAX_SPLITS)
    elif num_ctas >= 2 * num_sms:
        splits = 1
    else:
        splits = min(
            math.ceil(2 * num_sms / max(1, num_ctas)),
            math.ceil(max_kv / MIN_TOKENS_PER_SPLIT),
            instances.MAX_SPLITS,
        )
    return math.ceil(math.ceil(max_kv / max(1, splits)) / kv_tile) * kv_tile


@dataclass(frozen=True)
class PrefillPlan:
    """Everything the launches need besides the tensors: instances, grids and the integer
    metadata on the runner's device. Planning once and launching many times (as FlashInfer's
    plan/run does) keeps host work out of timed loops."""

    instance: instances.Instance
    grid: tuple[int, int, int]
    metadata: tuple[Any, ...]  # page indices, row starts, seq_lens, query_start_loc, tile arrays
    num_partials: int
    tokens_per_split: int
    merge_instance: instances.Instance
    merge_grid: tuple[int, int, int]
    merge_metadata: tuple[Any, ...]  # query_start_loc, merge_seq, merge_row0, merge_first, splits
    scalars: tuple[Any, ...]  # num_kv_heads, group, causal
    window: int = 0  # the kernel's sliding window (0: none)


def plan(
    runner: Runner, args: pval.PrefillArgs, num_splits: int | None = None, window: int | None = None
) -> PrefillPlan | None:
    """The launches for validated arguments, or None when there is no query row at all.
    window (causal only, checked by validation): splits and dispatch order count only the keys
    in each tile's window."""
    shape = args.shape
    check_kernel_shape(shape)
    base_seq, base_row0 = work_tiles(args.query_start_loc, shape.group)
    num_base = int(base_seq.shape[0])
    if num_base == 0:
        return None
    if int(args.table.row_start.max(initial=0)) > pval.MAX_KERNEL_ENTRIES:
        raise InvalidArgumentError("the page table has more entries than int32 offsets address")
    kv_needed = tile_kv_needed(
        args.query_start_loc, args.seq_lens, base_seq, base_row0, shape.group, shape.causal, window
    )
    tokens_per_split = choose_split_tokens(
        num_base * shape.num_kv_heads,
        kv_needed,
        instances.prefill_kv_tile(shape.head_dim),
        runner.num_sms,
        num_splits,
    )
    splits = np.maximum(1, -(-kv_needed // tokens_per_split))  # [num_base]
    total = int(splits.sum())
    base = np.repeat(np.arange(num_base, dtype=np.int64), splits)
    split_index = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(splits) - splits, splits)
    multi = splits > 1
    first = np.cumsum(np.where(multi, splits, 0)) - np.where(multi, splits, 0)  # first slot per base
    partial = np.where(multi[base], first[base] + split_index, -1)
    num_partials = int(np.where(multi, splits, 0).sum())
    # Keys each work item reads; dispatch order: most first (stable: ties keep row order).
    item_keys = np.minimum(tokens_per_split, kv_needed[base] - split_index * tokens_per_split)
    order = np.argsort(-item_keys, kind="stable")
    xp = runner.xp

    def dev(x: np.ndarray) -> Any:
        return xp.asarray(np.ascontiguousarray(x, dtype=np.int32))

    metadata = (
        dev(args.table.indices),
        dev(args.table.row_start),
        xp.asarray(args.seq_lens),
        xp.asarray(args.query_start_loc),
        dev(base_seq[base][order]),
        dev(base_row0[base][order]),
        dev(split_index[order]),
        dev(partial[order]),
    )
    merging = np.flatnonzero(multi)
    merge_metadata = (
        xp.asarray(args.query_start_loc),
        dev(base_seq[merging]),
        dev(base_row0[merging]),
        dev(first[merging]),
        dev(splits[merging]),
    )
    return PrefillPlan(
        instances.prefill(shape.kind, shape.head_dim, shape.block_size),
        (total, shape.num_kv_heads, 1),
        metadata,
        num_partials,
        tokens_per_split,
        instances.merge_prefill(shape.kind, shape.head_dim),
        (int(merging.shape[0]), shape.num_kv_heads, 1),
        merge_metadata,
        (np.int32(shape.num_kv_heads), np.int32(shape.group), np.int32(1 if shape.causal else 0)),
        kernel_window(window) if shape.causal else 0,
    )


def launch(runner: Runner, prefill_plan: PrefillPlan | None, args: pval.PrefillArgs) -> Any:
    """Runs a plan on the tensors of ``args``; returns the output [total_q, num_q_heads, head_dim]."""
    shape = args.shape
    out = _output(runner, tuple(args.q.shape), args.q.dtype, nan_fill_value(shape.kind))
    if prefill_plan is None:
        return out
    rows = (prefill_plan.num_partials, shape.num_kv_heads, instances.PREFILL_ROWS)
    if prefill_plan.num_partials:
        split_out = _output(runner, (*rows, shape.head_dim), np.float32, np.nan)
        split_ml = _output(runner, (*rows, 2), np.float32, np.nan)
    else:  # unused by the kernel when no tile is split
        split_out = split_ml = runner.xp.zeros(1, dtype=np.float32)
    num_kv_heads, group, causal = prefill_plan.scalars
    runner.launch(
        prefill_plan.instance,
        prefill_plan.grid,
        (instances.PREFILL_THREADS, 1, 1),
        [
            out,
            args.q,
            args.k_cache,
            args.v_cache,
            *prefill_plan.metadata,
            split_out,
            split_ml,
            num_kv_heads,
            group,
            causal,
            np.int32(prefill_plan.tokens_per_split),
            np.float32(shape.scale * LOG2E),
            np.int32(prefill_plan.window),
        ],
    )
    if prefill_plan.num_partials:
        runner.launch(
            prefill_plan.merge_instance,
            prefill_plan.merge_grid,
            (instances.PREFILL_THREADS, 1, 1),
            [out, split_out, split_ml, *prefill_plan.merge_metadata, num_kv_heads, group],
        )
    return out


def paged_prefill(
    runner: Runner, args: pval.PrefillArgs, num_splits: int | None = None, window: int | None = None
) -> Any:
    return launch(runner, plan(runner, args, num_splits, window), args)
