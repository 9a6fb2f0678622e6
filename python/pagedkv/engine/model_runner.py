"""The model runner: executes one scheduled batch on the paged K/V store.

It owns the per-layer caches (``PagedKvStore``), executes the batch's copy-on-write copies, lays
the rows out as one flat batch of tokens (positions, block tables, context and query lengths) and
runs ONE forward pass, asking the model for logits only at the rows that end a sequence's known
tokens (the sampling rows).
"""

from __future__ import annotations

import os

import numpy as np

import pagedkv
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.kv_store import PagedKvStore
from pagedkv.engine.scheduler import Row, ScheduledBatch
from pagedkv.errors import InvalidArgumentError
from pagedkv.models import LoadedModel

__all__ = ["ModelRunner"]


class ModelRunner:
    def __init__(self, model: LoadedModel, config: EngineConfig) -> None:
        self.model = model
        c = config
        kv_bytes = model.config.kv_bytes_per_token_fp32 * c.block_size * (c.num_blocks + c.num_host_blocks)
        memory = _physical_memory_bytes()
        if memory is not None and kv_bytes > memory:
            raise InvalidArgumentError(
                f"{c.num_blocks} + {c.num_host_blocks} host blocks of {c.block_size} tokens need "
                f"{kv_bytes / 2**30:,.1f} GiB of K/V; this machine has {memory / 2**30:,.1f} GiB"
            )
        try:
            self.store = PagedKvStore(model.config, c.num_blocks, c.block_size, c.num_host_blocks)
        except MemoryError as error:
            raise InvalidArgumentError(
                f"cannot allocate {kv_bytes / 2**30:,.1f} GiB of K/V for the engine's pool"
            ) from error

    def execute(self, kv: pagedkv.KvCacheManager, batch: ScheduledBatch) -> list[tuple[Row, np.ndarray]]:
        """Run the batch; (row, logits) for each sampling row, in row order."""
        rows = batch.rows
        self.store.copy(batch.copy_ops)
        tables, _ = kv.batch_block_tables([r.seq.seq_id for r in rows])
        ctx = np.array([r.end for r in rows], dtype=np.int32)
        q_lens = np.array([r.end - r.start for r in rows], dtype=np.int32)
        self.store.set_batch(tables, ctx, q_lens)
        tokens = np.concatenate([np.asarray(r.seq.token_ids[r.start : r.end], dtype=np.int64) for r in rows])
        positions = np.concatenate([np.arange(r.start, r.end, dtype=np.int64) for r in rows])
        ends = np.cumsum(q_lens) - 1
        sampling = [i for i, r in enumerate(rows) if r.samples]
        logits = self.model.model.forward(tokens, positions, self.store, ends[sampling])
        return [(rows[i], logits[k]) for k, i in enumerate(sampling)]


def _physical_memory_bytes() -> int | None:
    """The machine's RAM, where the OS says (None elsewhere: the allocation itself then decides)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, OSError, ValueError):
        return None
