"""Which physical blocks hold complete K/V for their tokens: the engine's shadow of the prefix
cache, so that a prefix hit is trusted only on blocks whose K/V exist.

``KvCacheManager`` enters a sequence's full blocks in its prefix index when the sequence is added,
before their K/V are computed; a second request admitted while the first is still prefilling the
same prefix would hit blocks not yet written, and the blocks of a preempted or abandoned prefill
stay indexed with incomplete contents. This state goes away once the allocator tracks a computed
watermark itself.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ComputedBlocks"]


class ComputedBlocks:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self._complete = np.zeros(num_blocks, dtype=bool)

    def trusted_blocks(self, table: np.ndarray, hit_blocks: int) -> int:
        """How many leading blocks of ``table`` (among the first ``hit_blocks``) are complete."""
        trusted = 0
        while trusted < hit_blocks and self._complete[table[trusted]]:
            trusted += 1
        return trusted

    def is_complete(self, block: int) -> bool:
        return bool(self._complete[block])

    def invalidate(self, blocks: np.ndarray) -> None:
        """These blocks' contents are not (or no longer) the K/V of their tokens."""
        self._complete[blocks] = False

    def mark_computed(self, table: np.ndarray, start: int, end: int) -> None:
        """Positions ``start..end`` of the sequence with block table ``table`` were just computed,
        every position before ``start`` already was: the blocks they fill are complete."""
        bs = self.block_size
        full = end // bs
        if full > start // bs:
            self._complete[table[start // bs : full]] = True

    def copied(self, copy_ops: np.ndarray) -> None:
        """Copy-on-write copies (src, dst) were executed: a copy is made on an append, so its
        destination holds a token whose K/V the coming pass computes (the pass marks it)."""
        if len(copy_ops):
            self._complete[copy_ops[:, 1]] = False
