"""Turns a validated ``paged_prefill_attention`` call into one kernel launch (``cuda`` and
``emulated`` backends share this code, so the emulation exercises the GPU's launch arithmetic).

The grid is a flat list of work tiles: sequence b's ``q_len * group`` packed (token, query head)
rows are cut into tiles of ``PREFILL_ROWS``, and every tile runs once per KV head. Rows with no
queries (``q_len == 0``) get no tile. The schedule is built on the host with NumPy (no Python loop
over sequences) and uploaded with the page table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedkv.attention import prefill_validation as pval
from pagedkv.attention.dtypes import nan_fill_value
from pagedkv.attention.kernel_launch import LOG2E, Runner, _output
from pagedkv.errors import InvalidArgumentError
from pagedkv.kernels import instances


def work_tiles(query_start_loc: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """(tile_seq, tile_row0), int32 [num_tiles]: each tile's sequence and first packed row."""
    q_lens = np.diff(query_start_loc.astype(np.int64))
    tiles = ((q_lens * group + instances.PREFILL_ROWS - 1) // instances.PREFILL_ROWS).astype(np.int64)
    total = int(tiles.sum())
    tile_seq = np.repeat(np.arange(q_lens.shape[0], dtype=np.int64), tiles)
    first = np.repeat(np.cumsum(tiles) - tiles, tiles)
    tile_row0 = (np.arange(total, dtype=np.int64) - first) * instances.PREFILL_ROWS
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


@dataclass(frozen=True)
class PrefillPlan:
    """Everything a launch needs besides the tensors: the instance, the grid and the integer
    metadata on the runner's device. Planning once and launching many times (as FlashInfer's
    plan/run does) keeps host work out of timed loops; one decode step or prefill chunk per plan."""

    instance: instances.Instance
    grid: tuple[int, int, int]
    metadata: tuple[Any, ...]  # page indices, row starts, seq_lens, query_start_loc, tile_seq, tile_row0
    scalars: tuple[Any, ...]  # num_kv_heads, group, causal, scale * log2(e)


def plan(runner: Runner, args: pval.PrefillArgs) -> PrefillPlan | None:
    """The launch for validated arguments, or None when there is no query row at all."""
    shape = args.shape
    check_kernel_shape(shape)
    tile_seq, tile_row0 = work_tiles(args.query_start_loc, shape.group)
    if tile_seq.shape[0] == 0:
        return None
    if int(args.table.row_start.max(initial=0)) > pval.MAX_KERNEL_ENTRIES:
        raise InvalidArgumentError("the page table has more entries than int32 offsets address")
    xp = runner.xp
    metadata = (
        xp.asarray(np.ascontiguousarray(args.table.indices, dtype=np.int32)),
        xp.asarray(args.table.row_start.astype(np.int32)),
        xp.asarray(args.seq_lens),
        xp.asarray(args.query_start_loc),
        xp.asarray(tile_seq),
        xp.asarray(tile_row0),
    )
    scalars = (
        np.int32(shape.num_kv_heads),
        np.int32(shape.group),
        np.int32(1 if shape.causal else 0),
        np.float32(shape.scale * LOG2E),
    )
    return PrefillPlan(
        instances.prefill(shape.kind, shape.head_dim, shape.block_size),
        (int(tile_seq.shape[0]), shape.num_kv_heads, 1),
        metadata,
        scalars,
    )


def launch(runner: Runner, prefill_plan: PrefillPlan | None, args: pval.PrefillArgs) -> Any:
    """Runs a plan on the tensors of ``args``; returns the output [total_q, num_q_heads, head_dim]."""
    out = _output(runner, tuple(args.q.shape), args.q.dtype, nan_fill_value(args.shape.kind))
    if prefill_plan is None:
        return out
    runner.launch(
        prefill_plan.instance,
        prefill_plan.grid,
        (instances.PREFILL_THREADS, 1, 1),
        [out, args.q, args.k_cache, args.v_cache, *prefill_plan.metadata, *prefill_plan.scalars],
    )
    return out


def paged_prefill(runner: Runner, args: pval.PrefillArgs) -> Any:
    return launch(runner, plan(runner, args), args)
