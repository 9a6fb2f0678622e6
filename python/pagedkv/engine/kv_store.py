"""The engine's K/V data plane: paged caches (device tier and host swap tier), and a
contiguous per-sequence buffer with the same arithmetic for equivalence tests.

The paged caches follow a ``KvLayout`` (``kv_layout.py``): one block table per KV group of
layers, the layers of a group sharing K/V tensors with those of the other groups.

A forward pass covers a flat batch of rows from several sequences; ``set_batch`` tells the store
which rows belong to which sequence, where their keys/values go and how long each sequence's
context is after the pass. ``attend`` then writes the layer's new K/V and attends every row over
its own history: one ``paged_prefill_attention`` call for the whole mixed batch (prefill chunks and
decode rows, a decode row being a one-query sequence) on the paged caches.

The data plane is ``backend="cpu"`` (the Rust kernels: threads, SIMD, the GIL released) unless
``PAGEDKV_DATA_PLANE=numpy`` selects the NumPy reference (bit-exact, ~100x slower per layer
call; for equivalence checks and before/after benchmarks). The caches are host NumPy arrays
either way.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from pagedkv.attention import (
    contiguous_attention,
    copy_blocks,
    paged_prefill_attention,
    swap_blocks,
    write_kv,
)
from pagedkv.engine.kv_layout import KvLayout, kv_layout
from pagedkv.errors import InvalidArgumentError
from pagedkv.models.gemma3.config import Gemma3Config
from pagedkv.models.llama.config import LlamaConfig

__all__ = ["ContiguousKvStore", "PagedKvStore", "default_backend"]

DATA_PLANES = ("cpu", "numpy")


def default_backend() -> str:
    """The engine's data plane: ``PAGEDKV_DATA_PLANE`` (cpu | numpy) when set, else ``cpu``."""
    choice = os.environ.get("PAGEDKV_DATA_PLANE", "cpu") or "cpu"
    if choice not in DATA_PLANES:
        raise InvalidArgumentError(f"PAGEDKV_DATA_PLANE must be one of {DATA_PLANES}, got {choice!r}")
    return choice


class PagedKvStore:
    """The K/V caches of a ``KvLayout``: ``layout.layers_per_group`` K tensors and as many V
    tensors ``[num_blocks, block_size, num_kv_heads, head_dim]`` (fp32), the i-th of each shared
    by the i-th layer of every KV group, and the swap tier's ``[num_host_blocks, ...]`` copies
    for swap. Each layer reads and writes through its own group's block table. Without a layout:
    one full-attention group of every layer (a tensor pair per layer)."""

    def __init__(
        self,
        config: LlamaConfig | Gemma3Config,
        num_blocks: int,
        block_size: int,
        num_host_blocks: int = 0,
        backend: str | None = None,
        layout: KvLayout | None = None,
    ) -> None:
        self.backend = default_backend() if backend is None else backend
        if self.backend not in DATA_PLANES:
            raise InvalidArgumentError(f"backend must be one of {DATA_PLANES}, got {self.backend!r}")
        self.layout = kv_layout([None] * config.num_layers) if layout is None else layout
        if self.layout.num_layers != config.num_layers:
            raise InvalidArgumentError(
                f"the KV layout covers {self.layout.num_layers} layers; the model has {config.num_layers}"
            )
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        host_shape = (num_host_blocks, *shape[1:])
        tensors = self.layout.layers_per_group
        self.block_size = block_size
        self.k_caches = [np.zeros(shape, np.float32) for _ in range(tensors)]
        self.v_caches = [np.zeros(shape, np.float32) for _ in range(tensors)]
        self.host_k = [np.zeros(host_shape, np.float32) for _ in range(tensors)]
        self.host_v = [np.zeros(host_shape, np.float32) for _ in range(tensors)]
        groups = self.layout.num_groups
        self._slots = [np.zeros(0, np.int64)] * groups
        self._tables = [np.zeros((0, 0), np.int32)] * groups
        self._ctx_lens = np.zeros(0, np.int32)
        self._q_lens = np.zeros(0, np.int32)
        self._query_start_loc = np.zeros(1, np.int32)

    @property
    def kv_bytes(self) -> int:
        return sum(c.nbytes for c in (*self.k_caches, *self.v_caches))

    @property
    def bytes_per_block(self) -> int:
        """What one block of any group holds in the device caches."""
        return sum(c[0].nbytes for c in (*self.k_caches, *self.v_caches))

    def set_batch(
        self,
        block_tables: np.ndarray | Sequence[np.ndarray],
        ctx_lens: np.ndarray,
        q_lens: np.ndarray,
    ) -> None:
        """Rows of sequence b are its positions ctx_lens[b] - q_lens[b] .. ctx_lens[b] - 1.

        ``block_tables``: one ``[B, max_blocks]`` table per KV group, in group order (a bare
        array for a one-group layout); ``-1`` marks a block a sliding-window group released,
        which no row of the batch may be written to."""
        if isinstance(block_tables, np.ndarray):
            block_tables = [block_tables]
        if len(block_tables) != self.layout.num_groups:
            raise InvalidArgumentError(
                f"{len(block_tables)} block tables for a layout of {self.layout.num_groups} KV groups"
            )
        bs = self.block_size
        ctx = np.asarray(ctx_lens, dtype=np.int64)
        q = np.asarray(q_lens, dtype=np.int64)
        # Every row's (sequence, position) at once: one gather instead of a loop over sequences.
        seq_of_row = np.repeat(np.arange(q.shape[0]), q)
        starts = np.cumsum(q) - q
        positions = (ctx - q)[seq_of_row] + np.arange(int(q.sum()), dtype=np.int64) - starts[seq_of_row]
        self._tables, self._slots = [], []
        for g, table in enumerate(block_tables):
            tables = np.ascontiguousarray(table, dtype=np.int32)
            blocks = tables[seq_of_row, positions // bs].astype(np.int64) if positions.size else positions
            if blocks.size and int(blocks.min()) < 0:
                row = int(np.argmin(blocks))
                raise InvalidArgumentError(
                    f"KV group {g}: the block of position {int(positions[row])} (a row this pass "
                    "writes) is released (-1 in the block table)"
                )
            self._tables.append(tables)
            self._slots.append(np.ascontiguousarray(blocks * bs + positions % bs, dtype=np.int64))
        self._ctx_lens = np.ascontiguousarray(ctx_lens, dtype=np.int32)
        self._q_lens = np.ascontiguousarray(q_lens, dtype=np.int32)
        self._query_start_loc = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)

    def attend(
        self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, window: int | None = None
    ) -> np.ndarray:
        """``window``: the layer's sliding window (Gemma 3's local layers), None for full attention.
        The window applies whatever the layout: under ``hybrid=False`` a local layer's group keeps
        every block, and the attention still reads only the window's keys."""
        group, index = self.layout.slot(layer)
        kc, vc = self.k_caches[index], self.v_caches[index]
        write_kv(k, v, kc, vc, self._slots[group], backend=self.backend)
        # The whole mixed batch in one call: sequence b's q_lens[b] rows are the last positions
        # of its ctx_lens[b]-token context (a decode row is a one-query sequence).
        return paged_prefill_attention(
            q,
            kc,
            vc,
            self._tables[group],
            self._ctx_lens,
            self._query_start_loc,
            backend=self.backend,
            window=window,
        )

    # A block id names the same row of every tensor, whichever group holds it: a copy or a swap
    # moves that row of each K and V tensor (all the layers of the block's group).

    def copy(self, copy_ops: np.ndarray) -> None:
        """Copy-on-write copies (src, dst) from KvCacheManager.take_copy_ops (any group)."""
        if len(copy_ops):
            copy_blocks(self.k_caches, self.v_caches, copy_ops, backend=self.backend)

    def write_block(self, block: int, payload: np.ndarray) -> None:
        """Write device block ``block`` whole from a store payload ``[tensors, 2, block_size,
        num_kv_heads, head_dim]`` (tensor i's K, then V)."""
        for index in range(len(self.k_caches)):
            self.k_caches[index][block] = payload[index, 0]
            self.v_caches[index][block] = payload[index, 1]

    def swap_out(self, mapping: np.ndarray) -> None:
        """(device_block, host_block) pairs from KvCacheManager.swap_out."""
        if len(mapping):
            for index in range(len(self.k_caches)):
                swap_blocks(self.k_caches[index], self.host_k[index], mapping, backend=self.backend)
                swap_blocks(self.v_caches[index], self.host_v[index], mapping, backend=self.backend)

    def swap_in(self, mapping: np.ndarray) -> None:
        """(host_block, device_block) pairs from KvCacheManager.swap_in."""
        if len(mapping):
            for index in range(len(self.k_caches)):
                swap_blocks(self.host_k[index], self.k_caches[index], mapping, backend=self.backend)
                swap_blocks(self.host_v[index], self.v_caches[index], mapping, backend=self.backend)


class ContiguousKvStore:
    """One contiguous ``[max_len, num_kv_heads, head_dim]`` buffer per sequence and layer, attended
    with ``contiguous_attention`` one query at a time (the reference the paged engine must equal)."""

    def __init__(self, config: LlamaConfig | Gemma3Config, max_len: int) -> None:
        self.config = config
        self.max_len = max_len
        self._k: dict[int, list[np.ndarray]] = {}
        self._v: dict[int, list[np.ndarray]] = {}
        self._rows: list[tuple[int, int]] = []  # (seq_id, position) per row

    def add(self, seq_id: int) -> None:
        c = self.config
        shape = (self.max_len, c.num_kv_heads, c.head_dim)
        self._k[seq_id] = [np.zeros(shape, np.float32) for _ in range(c.num_layers)]
        self._v[seq_id] = [np.zeros(shape, np.float32) for _ in range(c.num_layers)]

    def set_batch(self, seq_ids: list[int], ctx_lens: list[int], q_lens: list[int]) -> None:
        self._rows = [
            (sid, pos)
            for sid, ctx, q in zip(seq_ids, ctx_lens, q_lens, strict=True)
            for pos in range(ctx - q, ctx)
        ]

    def attend(
        self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, window: int | None = None
    ) -> np.ndarray:
        for row, (sid, pos) in enumerate(self._rows):
            self._k[sid][layer][pos] = k[row]
            self._v[sid][layer][pos] = v[row]
        out = np.empty_like(q)
        for row, (sid, pos) in enumerate(self._rows):
            lo = 0 if window is None else max(0, pos - window + 1)  # the window's keys, pos included
            out[row] = contiguous_attention(
                q[row], self._k[sid][layer][lo : pos + 1], self._v[sid][layer][lo : pos + 1]
            )
        return out
