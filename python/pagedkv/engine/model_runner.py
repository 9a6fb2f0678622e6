"""The model runner: executes one ``ScheduledBatch``, the one place where engine data moves.

It owns the K/V arrays: the paged caches (``PagedKvStore``, laid out by the model's
``KvLayout``: one block table per KV group of layers) with the swap tier's host copies, the
host cache's arrays (``HostCache``) and the blocks queued for the store (``StoreSaves``). It
never sees the scheduler (nor the block manager): the batch says everything, rows and data
moves, in the order to run them (``scheduled_batch.py``). It runs the batch's ops, lays the
rows out as one flat batch of tokens (positions, block tables, context and query lengths) and
runs ONE forward pass, asking the model for logits only at the rows that end a sequence's known
tokens (the sampling rows) and, for a speculative decode row, at every position that verifies a
draft (the last sampled token and each draft but the last: k drafts need k + 1 logits rows);
then it queues the blocks the pass filled for the store (save-on-compute).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.host_cache import HostCache
from pagedkv.engine.kv_budget import (
    pool_block_bytes,
    residual_bytes_per_sequence,
    residual_slot_counts,
    store_key_dtype,
)
from pagedkv.engine.kv_layout import KvLayout, kv_layout, layer_windows
from pagedkv.engine.kv_store import PagedKvStore
from pagedkv.engine.scheduled_batch import (
    CopyBlocks,
    CopyResidual,
    DataOp,
    Load,
    Offload,
    ReopenBlock,
    Row,
    ScheduledBatch,
    StoreHits,
    SwapIn,
    SwapOut,
)
from pagedkv.engine.store_saves import StoreSaves
from pagedkv.errors import InvalidArgumentError, InvariantViolation
from pagedkv.models import LoadedModel

if TYPE_CHECKING:
    from pagedkv.offload import OffloadWorker

__all__ = ["ModelRunner"]


class ModelRunner:
    """``store_worker``: the store's ``OffloadWorker`` when the engine has a store (its puts
    are keyed with ``store_identity``)."""

    def __init__(
        self,
        model: LoadedModel,
        config: EngineConfig,
        layout: KvLayout | None = None,
        store_worker: OffloadWorker | None = None,
        store_identity: bytes = b"",
    ) -> None:
        self.model = model
        c = config
        self.layout = kv_layout(layer_windows(model.config), hybrid=c.hybrid_kv) if layout is None else layout
        m = model.config
        dtype = c.cache_dtype
        per_block = pool_block_bytes(self.layout, c.block_size, m.num_kv_heads, m.head_dim, dtype)
        num_host = c.num_host_blocks + c.num_host_cache_blocks
        slots, host_slots = residual_slot_counts(dtype, c.max_num_seqs, c.num_host_blocks)
        per_seq = residual_bytes_per_sequence(self.layout, c.block_size, m.num_kv_heads, m.head_dim, dtype)
        kv_bytes = per_block * (c.pool_blocks + num_host) + per_seq * (slots + host_slots)
        memory = _physical_memory_bytes()
        if memory is not None and kv_bytes > memory:
            raise InvalidArgumentError(
                f"{c.pool_blocks} + {num_host} host blocks of {c.block_size} tokens need "
                f"{kv_bytes / 2**30:,.1f} GiB of K/V; this machine has {memory / 2**30:,.1f} GiB"
            )
        try:
            self.store = PagedKvStore(
                model.config,
                c.pool_blocks,
                c.block_size,
                c.num_host_blocks,
                layout=self.layout,
                kv_cache_dtype=dtype,
                num_residual_slots=slots,
                num_host_residual_slots=host_slots,
            )
            self.host_cache = (
                HostCache(self.store, c.num_host_cache_blocks) if c.num_host_cache_blocks else None
            )
        except MemoryError as error:
            raise InvalidArgumentError(
                f"cannot allocate {kv_bytes / 2**30:,.1f} GiB of K/V for the engine's pool"
            ) from error
        self.saves = (
            StoreSaves(store_worker, store_identity, self.store, store_key_dtype(dtype))
            if store_worker is not None
            else None
        )

    def execute(self, batch: ScheduledBatch) -> list[tuple[Row, np.ndarray]]:
        """Run the batch's data ops in order, then its pass (if it has rows), then its
        save-on-compute; (row, logits ``[row.num_logits, vocab]``) for each sampling row, in row
        order: the logits of the row's last ``num_logits`` positions."""
        for op in batch.ops:
            self._move(op)
        rows = batch.rows
        if not rows:
            return []
        ctx = np.array([r.end for r in rows], dtype=np.int32)
        q_lens = np.array([r.end - r.start for r in rows], dtype=np.int32)
        self.store.set_batch(batch.block_tables, ctx, q_lens, batch.residual_slots)
        tokens = np.concatenate([_row_tokens(r) for r in rows])
        positions = np.concatenate([np.arange(r.start, r.end, dtype=np.int64) for r in rows])
        ends = np.cumsum(q_lens)  # one past each row's last flat index
        sampling = [i for i, r in enumerate(rows) if r.samples]
        counts = [rows[i].num_logits for i in sampling]
        wanted = [np.arange(ends[i] - n, ends[i]) for i, n in zip(sampling, counts, strict=True)]
        flat = np.concatenate(wanted) if wanted else np.zeros(0, np.int64)
        logits = self.model.model.forward(tokens, positions, self.store, flat)
        if batch.save is not None and self.saves is not None:
            # Copied before the next step's offloads, copies and loads may write the blocks (a
            # failed pass saves nothing).
            self.saves.save_computed(batch.save.blocks, batch.save.hashes)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(int)
        return [(rows[i], logits[offsets[k] : offsets[k + 1]]) for k, i in enumerate(sampling)]

    def _move(self, op: DataOp) -> None:
        if isinstance(op, SwapOut):
            self.store.swap_out(op.mapping, op.residual)
        elif isinstance(op, SwapIn):
            self.store.swap_in(op.mapping, op.residual)
        elif isinstance(op, CopyResidual):
            self.store.copy_residual(op.pairs)
        elif isinstance(op, ReopenBlock):
            self.store.reopen(op.slot, op.num_tokens, op.blocks)
        elif isinstance(op, CopyBlocks):
            self.store.copy(op.ops)
        elif isinstance(op, Offload):
            self._host_cache().offload(op.ops)
            self._write_through(op)
        elif isinstance(op, Load):
            self._host_cache().load(op.ops)
        elif isinstance(op, StoreHits):
            for block, block_hash, payload in op.blocks:
                self.store.write_block(block, payload)
                if self.saves is not None:
                    self.saves.remember(block_hash)  # in the store already: never written back
        else:
            raise InvariantViolation(f"unknown data op {type(op).__name__}: a pagedkv bug, please report it")

    def _write_through(self, op: Offload) -> None:
        """The host-cache blocks an offload filled go to the store (under ``"compute"`` they
        were saved when computed, unless the queue dropped them: the seen-set skips them)."""
        if self.saves is None:
            return
        cache = self._host_cache()
        for host_block, block_hash in zip(op.ops[:, 1].tolist(), op.hashes, strict=True):
            if block_hash is None or self.saves.seen_before(block_hash):
                continue
            self.saves.submit(block_hash, cache.payload(host_block))

    def _host_cache(self) -> HostCache:
        if self.host_cache is None:
            raise InvariantViolation("a host-cache op without a host cache: a pagedkv bug, please report it")
        return self.host_cache


def _row_tokens(row: Row) -> np.ndarray:
    """The row's token ids: the sequence's known tokens, then its drafts."""
    seq = row.seq
    known = len(seq.token_ids)
    head = seq.token_ids[row.start : min(row.end, known)]
    tail = seq.draft_ids[max(row.start - known, 0) : max(row.end - known, 0)]
    return np.asarray(head + tail, dtype=np.int64)


def _physical_memory_bytes() -> int | None:
    """The machine's RAM, where the OS says (None elsewhere: the allocation itself then decides)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, OSError, ValueError):
        return None
