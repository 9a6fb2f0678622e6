"""HostCache: the K/V arrays of the manager's host cache (``EngineConfig.num_host_cache_blocks``).

The manager decides (docs/offload.md): an evicted prefix block is kept in a host-cache block
(an ``Offload`` op of the plan), and a later prompt's hit on it gets a fresh device block (a
``Load`` op). This module moves those blocks between the engine's device caches
(``PagedKvStore``) and its own host arrays, for the model runner; the plan fixes the order
(``scheduled_batch.py``).
"""

from __future__ import annotations

import numpy as np

from pagedkv.attention import swap_blocks
from pagedkv.engine.kv_store import PagedKvStore, block_payloads, new_caches

__all__ = ["HostCache"]


class HostCache:
    """Host caches ``[num_blocks, block_size, num_kv_heads, head_dim]`` per K/V tensor of
    ``caches``, K and V, in the device caches' dtype (a quantized block moves as its bytes; only
    full, sealed blocks ever come here, so an int4 host cache needs no residual)."""

    def __init__(self, caches: PagedKvStore, num_blocks: int) -> None:
        self.caches = caches
        if caches.k_caches:
            shape = (num_blocks, caches.block_size, caches.num_kv_heads, caches.head_dim)
            dtype, count = caches.kv_cache_dtype, len(caches.k_caches)
            self.host_k = new_caches(dtype, "key", count, shape)
            self.host_v = new_caches(dtype, "value", count, shape)
        else:
            self.host_k, self.host_v = [], []

    def offload(self, ops: np.ndarray) -> None:
        """Device -> host copies (device_block, host_block), every tensor; one op per host
        block."""
        backend = self.caches.backend
        for layer in range(len(self.host_k)):
            swap_blocks(self.caches.k_caches[layer], self.host_k[layer], ops, backend=backend)
            swap_blocks(self.caches.v_caches[layer], self.host_v[layer], ops, backend=backend)

    def load(self, ops: np.ndarray) -> None:
        """Host -> device copies (host_block, device_block) of host-cache hits."""
        if len(ops):
            backend = self.caches.backend
            for layer in range(len(self.host_k)):
                swap_blocks(self.host_k[layer], self.caches.k_caches[layer], ops, backend=backend)
                swap_blocks(self.host_v[layer], self.caches.v_caches[layer], ops, backend=backend)

    def payload(self, host_block: int) -> np.ndarray:
        """A copy of what ``host_block`` holds, as a store payload (``kv_store.block_payloads``)."""
        return block_payloads(self.host_k, self.host_v, np.array([host_block]))[0]
