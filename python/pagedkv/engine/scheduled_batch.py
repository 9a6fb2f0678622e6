"""ScheduledBatch: one step's plan, made by the scheduler and executed by the model runner.

The scheduler decides (it talks to the block manager and to nothing that holds K/V); the model
runner moves data (it holds the K/V arrays and never sees the scheduler). Between them passes
this plan: the rows the forward pass computes, their block tables, and every data move of the
step as an op, in the order the runner must run them (docs/engine.md, "One step"):

1. the moves the scheduler recorded while it planned, in recording order: before each swap-in
   the offload ops recorded so far (``Offload``: device blocks the host cache keeps; each
   reads a device block before its new owner writes it), the swap-in itself (``SwapIn``),
   swap-outs of preempted sequences (``SwapOut``);
2. the rest of the step's offload ops (``Offload``);
3. copy-on-write copies (``CopyBlocks``), host-cache hits (``Load``), store hits
   (``StoreHits``): after every offload, as a copy may read a block a load then overwrites;
4. the forward pass over ``rows``;
5. save-on-compute (``save``): the blocks the pass filled go to the store, copied out before
   the next step can write them.

This is the order ``KvCacheManager`` documents for its ops (docs/offload.md, "The order the
caller runs the ops in"), in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pagedkv.engine.sequence import Sequence

__all__ = [
    "CopyBlocks",
    "DataOp",
    "Load",
    "Offload",
    "Row",
    "SaveComputed",
    "ScheduledBatch",
    "StoreHits",
    "SwapIn",
    "SwapOut",
]


@dataclass(frozen=True)
class Row:
    """Positions ``start..end`` of ``seq``'s tokens (``token_ids`` then ``draft_ids``), computed
    by this pass. A decode row starts at the last sampled token and covers the drafts after it."""

    seq: Sequence
    start: int
    end: int
    decode: bool = False

    @property
    def samples(self) -> bool:
        """The row ends the sequence's known tokens: its logits give the next token(s)."""
        return self.end == len(self.seq.token_ids) + len(self.seq.draft_ids)

    @property
    def num_logits(self) -> int:
        """Rows whose logits the engine needs: the last one, and one per draft before it."""
        return 1 + len(self.seq.draft_ids) if self.decode else 1


@dataclass(frozen=True)
class SwapOut:
    """int32 ``[N, 2]`` (device_block, host_block) from ``KvCacheManager.swap_out``: device ->
    swap tier, every K/V tensor."""

    mapping: np.ndarray


@dataclass(frozen=True)
class SwapIn:
    """int32 ``[N, 2]`` (host_block, device_block) from ``KvCacheManager.swap_in``."""

    mapping: np.ndarray


@dataclass(frozen=True)
class Offload:
    """int32 ``[N, 2]`` (device_block, host_block): device blocks the host cache keeps, one op
    per host block (of the manager's ops into one host block only the last one's content stays,
    and the copy kernels refuse a destination named twice). ``hashes[i]``: the chained hash of
    what host block ``ops[i, 1]`` holds afterwards, to write through to the store (None: no
    store, or nothing to write)."""

    ops: np.ndarray
    hashes: tuple[int | None, ...] = ()


@dataclass(frozen=True)
class CopyBlocks:
    """int32 ``[N, 2]`` (src, dst) copy-on-write copies from ``KvCacheManager.take_copy_ops``."""

    ops: np.ndarray


@dataclass(frozen=True)
class Load:
    """int32 ``[N, 2]`` (host_block, device_block): host-cache hits into their fresh device
    blocks (``KvCacheManager.take_load_ops``)."""

    ops: np.ndarray


@dataclass(frozen=True)
class StoreHits:
    """Store hits: ``(device_block, block_hash, payload [layers, 2, block_size, heads,
    head_dim])`` each, the payload written into the fresh device block. The hashes are in the
    store already: the runner never writes them back."""

    blocks: tuple[tuple[int, int, np.ndarray], ...]


DataOp = SwapOut | SwapIn | Offload | CopyBlocks | Load | StoreHits


@dataclass(frozen=True)
class SaveComputed:
    """Save-on-compute, after the pass: device ``blocks[i]`` (all its tokens computed by this
    pass) holds the content of chained hash ``hashes[i]`` (two rows of equal prompts may name
    one hash twice: it is saved once)."""

    blocks: tuple[int, ...]
    hashes: tuple[int, ...]


@dataclass(frozen=True)
class ScheduledBatch:
    """One step: ``ops`` run in order, then the pass over ``rows`` (none: the step only moves
    data), then ``save``. ``block_tables``: one int32 ``[len(rows), max_blocks]`` table per KV
    group, row order (``-1`` pads, and marks a block a sliding-window group released)."""

    rows: list[Row]
    block_tables: list[np.ndarray] = field(default_factory=list)
    ops: list[DataOp] = field(default_factory=list)
    save: SaveComputed | None = None
