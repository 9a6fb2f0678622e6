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
from pagedkv.engine.kv_store import PagedKvStore

__all__ = ["HostCache"]


class HostCache:
    """Host arrays ``[num_blocks, block_size, num_kv_heads, head_dim]`` (fp32) per K/V tensor
    of ``caches``, K and V."""

    def __init__(self, caches: PagedKvStore, num_blocks: int) -> None:
        self.caches = caches
        shape = (num_blocks, *caches.k_caches[0].shape[1:]) if caches.k_caches else (0,)
        self.host_k = [np.zeros(shape, np.float32) for _ in caches.k_caches]
        self.host_v = [np.zeros(shape, np.float32) for _ in caches.v_caches]

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
        """A copy of what ``host_block`` holds, as a store payload ``[layers, 2, block_size,
        heads, head_dim]``."""
        return np.stack(
            [
                np.stack([self.host_k[layer][host_block], self.host_v[layer][host_block]])
                for layer in range(len(self.host_k))
            ]
        )
