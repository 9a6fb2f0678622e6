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

The caches' storage is ``EngineConfig.kv_cache_dtype`` (``kv_budget.py``): fp32 (the default),
a 16-bit dtype, or a quantized one (``QuantizedKvCache``: int8 / fp8_e4m3 codes and scales in
the block, int4 with each sequence's open block in an int8 residual slot, one per KV group:
residual index ``slot * num_groups + group``). Queries, keys and values go to the attention calls
in ``kv_budget.attention_dtype`` and come back as fp32.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from pagedkv.attention import (
    QuantizedKvCache,
    contiguous_attention,
    copy_blocks,
    paged_prefill_attention,
    swap_blocks,
    write_kv,
)
from pagedkv.attention.dtypes import float32_to_bf16_bits, to_compute
from pagedkv.attention.quant_codec import decode_blocks, write_tokens_8bit
from pagedkv.engine.kv_budget import (
    attention_dtype,
    check_engine_kv_cache_dtype,
    has_residual,
    pool_block_bytes,
)
from pagedkv.engine.kv_layout import KvLayout, kv_layout
from pagedkv.errors import InvalidArgumentError
from pagedkv.models.gemma3.config import Gemma3Config
from pagedkv.models.llama.config import LlamaConfig

__all__ = ["ContiguousKvStore", "PagedKvStore", "default_backend", "new_caches"]

DATA_PLANES = ("cpu", "numpy")


def default_backend() -> str:
    """The engine's data plane: ``PAGEDKV_DATA_PLANE`` (cpu | numpy) when set, else ``cpu``."""
    choice = os.environ.get("PAGEDKV_DATA_PLANE", "cpu") or "cpu"
    if choice not in DATA_PLANES:
        raise InvalidArgumentError(f"PAGEDKV_DATA_PLANE must be one of {DATA_PLANES}, got {choice!r}")
    return choice


# Element storage of the plain caches (bfloat16 as uint16 bit patterns).
_STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


def new_caches(
    kv_cache_dtype: str,
    role: str,
    count: int,
    shape: tuple[int, int, int, int],
    num_residual_slots: int = 0,
) -> list[Any]:
    """``count`` zeroed caches of ``shape`` ``[num_blocks, block_size, num_kv_heads, head_dim]``
    in ``kv_cache_dtype`` (quantized: ``QuantizedKvCache`` of ``role``, int4 with
    ``num_residual_slots`` int8 residual slots)."""
    if kv_cache_dtype in _STORAGE:
        return [np.zeros(shape, _STORAGE[kv_cache_dtype]) for _ in range(count)]
    return [
        QuantizedKvCache.empty(
            kv_cache_dtype,
            role,
            *shape,
            num_residual_slots=num_residual_slots if has_residual(kv_cache_dtype) else 0,
        )
        for _ in range(count)
    ]


def block_payloads(k_caches: list[Any], v_caches: list[Any], blocks: np.ndarray) -> np.ndarray:
    """Blocks ``blocks`` of every tensor as store payloads, one per block: plain caches
    ``[tensors, 2, block_size, num_kv_heads, head_dim]`` (K then V) in their storage dtype,
    quantized ones uint8 ``[tensors, key_block_bytes + value_block_bytes]`` (each tensor's K
    block's bytes, then its V block's: codes and scales as they are)."""
    ids = np.asarray(blocks, dtype=np.intp)
    if not k_caches:
        return np.zeros((len(ids), 0), np.uint8)
    if isinstance(k_caches[0], QuantizedKvCache):
        kb = k_caches[0].layout.block_bytes
        out = np.empty((len(ids), len(k_caches), kb + v_caches[0].layout.block_bytes), np.uint8)
        for i, (k, v) in enumerate(zip(k_caches, v_caches, strict=True)):
            np.take(k.data, ids, axis=0, out=out[:, i, :kb])
            np.take(v.data, ids, axis=0, out=out[:, i, kb:])
        return out
    out = np.empty((len(ids), len(k_caches), 2, *k_caches[0].shape[1:]), k_caches[0].dtype)
    for i, (k, v) in enumerate(zip(k_caches, v_caches, strict=True)):
        np.take(k, ids, axis=0, out=out[:, i, 0])
        np.take(v, ids, axis=0, out=out[:, i, 1])
    return out


def write_payload(k_caches: list[Any], v_caches: list[Any], block: int, payload: np.ndarray) -> None:
    """Block ``block`` of every tensor written whole from one ``block_payloads`` payload."""
    for i, (k, v) in enumerate(zip(k_caches, v_caches, strict=True)):
        if isinstance(k, QuantizedKvCache):
            kb = k.layout.block_bytes
            k.data[block] = payload[i, :kb]
            v.data[block] = payload[i, kb:]
        else:
            k[block] = payload[i, 0]
            v[block] = payload[i, 1]


class PagedKvStore:
    """The K/V caches of a ``KvLayout``: ``layout.layers_per_group`` K tensors and as many V
    tensors ``[num_blocks, block_size, num_kv_heads, head_dim]`` in ``kv_cache_dtype`` (module
    docs), the i-th of each shared by the i-th layer of every KV group, and the swap tier's
    ``[num_host_blocks, ...]`` copies for swap. Each layer reads and writes through its own
    group's block table. Without a layout: one full-attention group of every layer (a tensor
    pair per layer). An int4 store has ``num_residual_slots`` device and
    ``num_host_residual_slots`` host residual slots per KV group."""

    def __init__(
        self,
        config: LlamaConfig | Gemma3Config,
        num_blocks: int,
        block_size: int,
        num_host_blocks: int = 0,
        backend: str | None = None,
        layout: KvLayout | None = None,
        kv_cache_dtype: str | None = None,
        num_residual_slots: int = 0,
        num_host_residual_slots: int = 0,
    ) -> None:
        self.backend = default_backend() if backend is None else backend
        if self.backend not in DATA_PLANES:
            raise InvalidArgumentError(f"backend must be one of {DATA_PLANES}, got {self.backend!r}")
        self.layout = kv_layout([None] * config.num_layers) if layout is None else layout
        if self.layout.num_layers != config.num_layers:
            raise InvalidArgumentError(
                f"the KV layout covers {self.layout.num_layers} layers; the model has {config.num_layers}"
            )
        self.kv_cache_dtype = check_engine_kv_cache_dtype(kv_cache_dtype)
        self.kind = attention_dtype(self.kv_cache_dtype)
        self.residual = has_residual(self.kv_cache_dtype)
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        host_shape = (num_host_blocks, *shape[1:])
        tensors = self.layout.layers_per_group
        groups = self.layout.num_groups
        self.block_size = block_size
        self.num_kv_heads, self.head_dim = config.num_kv_heads, config.head_dim
        dtype = self.kv_cache_dtype
        self.k_caches = new_caches(dtype, "key", tensors, shape, num_residual_slots * groups)
        self.v_caches = new_caches(dtype, "value", tensors, shape, num_residual_slots * groups)
        self.host_k = new_caches(dtype, "key", tensors, host_shape, num_host_residual_slots * groups)
        self.host_v = new_caches(dtype, "value", tensors, host_shape, num_host_residual_slots * groups)
        self._slots = [np.zeros(0, np.int64)] * groups
        self._tables = [np.zeros((0, 0), np.int32)] * groups
        self._ctx_lens = np.zeros(0, np.int32)
        self._q_lens = np.zeros(0, np.int32)
        self._query_start_loc = np.zeros(1, np.int32)
        self._seq_residual: list[np.ndarray | None] = [None] * groups
        self._token_residual: list[np.ndarray | None] = [None] * groups

    @property
    def kv_bytes(self) -> int:
        """Bytes of the device caches: blocks and (int4) residual slots."""
        return sum(int(c.nbytes) for c in (*self.k_caches, *self.v_caches))

    @property
    def bytes_per_block(self) -> int:
        """What one block of any group holds in the device caches."""
        return pool_block_bytes(
            self.layout, self.block_size, self.num_kv_heads, self.head_dim, self.kv_cache_dtype
        )

    def set_batch(
        self,
        block_tables: np.ndarray | Sequence[np.ndarray],
        ctx_lens: np.ndarray,
        q_lens: np.ndarray,
        residual_slots: np.ndarray | None = None,
    ) -> None:
        """Rows of sequence b are its positions ctx_lens[b] - q_lens[b] .. ctx_lens[b] - 1.

        ``block_tables``: one ``[B, max_blocks]`` table per KV group, in group order (a bare
        array for a one-group layout); ``-1`` marks a block a sliding-window group released,
        which no row of the batch may be written to. ``residual_slots`` (int4): each sequence's
        residual slot."""
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
        if self.residual:
            if residual_slots is None or len(residual_slots) != len(q):
                raise InvalidArgumentError("an int4 store needs each sequence's residual slot")
            groups = self.layout.num_groups
            seq = np.asarray(residual_slots, dtype=np.int32) * groups
            self._seq_residual = [np.ascontiguousarray(seq + g, dtype=np.int32) for g in range(groups)]
            tokens = seq[seq_of_row] if positions.size else np.zeros(0, np.int32)
            self._token_residual = [np.ascontiguousarray(tokens + g, dtype=np.int32) for g in range(groups)]

    def attend(
        self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, window: int | None = None
    ) -> np.ndarray:
        """``window``: the layer's sliding window (Gemma 3's local layers), None for full attention.
        The window applies whatever the layout: under ``hybrid=False`` a local layer's group keeps
        every block, and the attention still reads only the window's keys."""
        group, index = self.layout.slot(layer)
        kc, vc = self.k_caches[index], self.v_caches[index]
        kind = self.kind
        if kind != "float32":
            q, k, v = _to_attention(q, kind), _to_attention(k, kind), _to_attention(v, kind)
        write_kv(
            k, v, kc, vc, self._slots[group], backend=self.backend, residual_slots=self._token_residual[group]
        )
        # The whole mixed batch in one call: sequence b's q_lens[b] rows are the last positions
        # of its ctx_lens[b]-token context (a decode row is a one-query sequence).
        out = paged_prefill_attention(
            q,
            kc,
            vc,
            self._tables[group],
            self._ctx_lens,
            self._query_start_loc,
            backend=self.backend,
            window=window,
            residual_slots=self._seq_residual[group],
        )
        return out if kind == "float32" else _from_attention(out, kind)

    # A block id names the same row of every tensor, whichever group holds it: a copy or a swap
    # moves that row of each K and V tensor (all the layers of the block's group).

    def copy(self, copy_ops: np.ndarray) -> None:
        """Copy-on-write copies (src, dst) from KvCacheManager.take_copy_ops (any group)."""
        if len(copy_ops):
            copy_blocks(self.k_caches, self.v_caches, copy_ops, backend=self.backend)

    @property
    def payload_spec(self) -> tuple[np.dtype, tuple[int, ...]]:
        """(dtype, shape) of one block's store payload (``block_payloads``)."""
        probe = block_payloads(self.k_caches, self.v_caches, np.zeros(0, np.intp))
        return probe.dtype, probe.shape[1:]

    def write_block(self, block: int, payload: np.ndarray) -> None:
        """Write device block ``block`` whole from a store payload (``block_payloads``)."""
        write_payload(self.k_caches, self.v_caches, block, payload)

    def swap_out(self, mapping: np.ndarray, residual: np.ndarray | None = None) -> None:
        """(device_block, host_block) pairs from KvCacheManager.swap_out; ``residual``: (device
        slot, host slot) pairs of an int4 store."""
        if len(mapping):
            for index in range(len(self.k_caches)):
                swap_blocks(self.k_caches[index], self.host_k[index], mapping, backend=self.backend)
                swap_blocks(self.v_caches[index], self.host_v[index], mapping, backend=self.backend)
        self._move_residual(self.k_caches, self.host_k, residual)
        self._move_residual(self.v_caches, self.host_v, residual)

    def swap_in(self, mapping: np.ndarray, residual: np.ndarray | None = None) -> None:
        """(host_block, device_block) pairs from KvCacheManager.swap_in; ``residual``: (host
        slot, device slot) pairs."""
        if len(mapping):
            for index in range(len(self.k_caches)):
                swap_blocks(self.host_k[index], self.k_caches[index], mapping, backend=self.backend)
                swap_blocks(self.host_v[index], self.v_caches[index], mapping, backend=self.backend)
        self._move_residual(self.host_k, self.k_caches, residual)
        self._move_residual(self.host_v, self.v_caches, residual)

    def _group_pairs(self, pairs: np.ndarray) -> np.ndarray:
        """Sequence-slot pairs as residual-index pairs of every KV group."""
        groups = self.layout.num_groups
        base = np.asarray(pairs, dtype=np.int64).reshape(-1, 1, 2) * groups
        return (base + np.arange(groups).reshape(1, -1, 1)).reshape(-1, 2).astype(np.int32)

    def _move_residual(self, src: list[Any], dst: list[Any], pairs: np.ndarray | None) -> None:
        if pairs is None or not len(pairs):
            return
        mapping = self._group_pairs(pairs)
        for a, b in zip(src, dst, strict=True):
            swap_blocks(a.residual, b.residual, mapping, backend=self.backend)

    def copy_residual(self, pairs: np.ndarray) -> None:
        """A forked sample's copy of its parent's residual slot: (src slot, dst slot) pairs."""
        if len(pairs):
            mapping = self._group_pairs(pairs)
            copy_blocks(
                [k.residual for k in self.k_caches],
                [v.residual for v in self.v_caches],
                mapping,
                backend=self.backend,
            )

    def reopen(self, slot: int, num_tokens: int, blocks: Sequence[int]) -> None:
        """A sealed int4 block reopened: its first ``num_tokens`` tokens, dequantized (the
        codec's values, as attention read them) and written into residual ``slot`` (quantized
        to int8, as every residual token is), every KV group (``blocks[g]``) and tensor."""
        groups = self.layout.num_groups
        offsets = np.arange(num_tokens, dtype=np.int64)
        for g, block in enumerate(blocks):
            index = np.full(num_tokens, slot * groups + g, dtype=np.int64)
            for cache in (*self.k_caches, *self.v_caches):
                values = decode_blocks(cache.data[[int(block)]], cache.layout)[0, :num_tokens]
                res = cache.residual
                write_tokens_8bit(res.data, res.layout, values, index, offsets)


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


def _to_attention(x: np.ndarray, kind: str) -> np.ndarray:
    """fp32 activations in the attention kind (bfloat16 as bits), C-contiguous."""
    if kind == "float32":
        return np.ascontiguousarray(x, dtype=np.float32)
    if kind == "bfloat16":
        return float32_to_bf16_bits(x)
    return np.ascontiguousarray(x, dtype=np.float16)


def _from_attention(x: np.ndarray, kind: str) -> np.ndarray:
    """An attention output back in fp32 (exact)."""
    return to_compute(x, kind).astype(np.float32, copy=False)
