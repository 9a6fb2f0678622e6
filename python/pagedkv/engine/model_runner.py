"""The model runner: executes one scheduled batch on the paged K/V store.

It owns the paged caches (``PagedKvStore``, laid out by the model's ``KvLayout``: one block
table per KV group of layers), executes the batch's copy-on-write copies, lays
the rows out as one flat batch of tokens (positions, block tables, context and query lengths) and
runs ONE forward pass, asking the model for logits only at the rows that end a sequence's known
tokens (the sampling rows) and, for a speculative decode row, at every position that verifies a
draft (the last sampled token and each draft but the last: k drafts need k + 1 logits rows).
"""

from __future__ import annotations

import os

import numpy as np

import pagedkv
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.kv_layout import KvLayout, kv_layout, layer_windows
from pagedkv.engine.kv_store import PagedKvStore
from pagedkv.engine.offload_tiers import OffloadTiers, layout_identity, model_fingerprint
from pagedkv.engine.scheduler import Row, ScheduledBatch
from pagedkv.errors import InvalidArgumentError
from pagedkv.models import LoadedModel

__all__ = ["ModelRunner"]


class ModelRunner:
    def __init__(self, model: LoadedModel, config: EngineConfig, layout: KvLayout | None = None) -> None:
        self.model = model
        c = config
        self.layout = kv_layout(layer_windows(model.config), hybrid=c.hybrid_kv) if layout is None else layout
        m = model.config
        per_block = self.layout.bytes_per_block(c.block_size, m.num_kv_heads, m.head_dim)
        num_host = c.num_host_blocks + c.offload_blocks
        kv_bytes = per_block * (c.num_blocks + num_host)
        memory = _physical_memory_bytes()
        if memory is not None and kv_bytes > memory:
            raise InvalidArgumentError(
                f"{c.num_blocks} + {num_host} host blocks of {c.block_size} tokens need "
                f"{kv_bytes / 2**30:,.1f} GiB of K/V; this machine has {memory / 2**30:,.1f} GiB"
            )
        try:
            self.store = PagedKvStore(
                model.config, c.num_blocks, c.block_size, c.num_host_blocks, layout=self.layout
            )
        except MemoryError as error:
            raise InvalidArgumentError(
                f"cannot allocate {kv_bytes / 2**30:,.1f} GiB of K/V for the engine's pool"
            ) from error
        self.tiers: OffloadTiers | None = None
        if c.offload_blocks:
            cfg = model.config
            identity = layout_identity(
                model_fingerprint(model), cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, c.block_size
            )
            self.tiers = OffloadTiers(
                self.store, c.offload_blocks, c.offload, identity, c.offload_deadline_s, c.offload_policy
            )

    def execute(self, kv: pagedkv.KvCacheManager, batch: ScheduledBatch) -> list[tuple[Row, np.ndarray]]:
        """Run the batch; (row, logits ``[row.num_logits, vocab]``) for each sampling row, in row
        order: the logits of the row's last ``num_logits`` positions."""
        rows = batch.rows
        self.store.copy(batch.copy_ops)
        if self.tiers is not None:
            # After the copies (a copy may read a block a load then overwrites), before the pass.
            self.tiers.load(batch.load_ops)
            self.tiers.write(batch.store_writes)
        seq_ids = [r.seq.seq_id for r in rows]
        if self.layout.is_hybrid:
            tables = [kv.batch_block_tables(seq_ids, group=g)[0] for g in range(self.layout.num_groups)]
        else:
            tables = [kv.batch_block_tables(seq_ids)[0]]
        ctx = np.array([r.end for r in rows], dtype=np.int32)
        q_lens = np.array([r.end - r.start for r in rows], dtype=np.int32)
        self.store.set_batch(tables, ctx, q_lens)
        tokens = np.concatenate([_row_tokens(r) for r in rows])
        positions = np.concatenate([np.arange(r.start, r.end, dtype=np.int64) for r in rows])
        ends = np.cumsum(q_lens)  # one past each row's last flat index
        sampling = [i for i, r in enumerate(rows) if r.samples]
        counts = [rows[i].num_logits for i in sampling]
        wanted = [np.arange(ends[i] - n, ends[i]) for i, n in zip(sampling, counts, strict=True)]
        flat = np.concatenate(wanted) if wanted else np.zeros(0, np.int64)
        logits = self.model.model.forward(tokens, positions, self.store, flat)
        if self.tiers is not None:
            # Save-on-compute: the blocks this pass filled, copied before the next step's offload
            # ops, copies and loads may write them (a failed pass saves nothing).
            self.tiers.save_computed(kv, rows)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(int)
        return [(rows[i], logits[offsets[k] : offsets[k + 1]]) for k, i in enumerate(sampling)]


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
