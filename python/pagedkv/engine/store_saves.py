"""StoreSaves: the model runner's side of the store (``EngineConfig(offload=store)``): the
blocks it writes there.

Blocks go to the store on the ``OffloadWorker``'s thread (``submit_put`` queues a copy; a full
queue drops the put rather than wait), keyed by their chained hash and the engine's layout
identity as the salt (``store_identity.py``). When depends on the policy
(``EngineConfig.offload_policy``): ``"compute"`` saves every full block right after the pass
that computed it (the plan's ``SaveComputed``: the K/V are copied out of the device caches
before the next step can reuse the block), so that replicas sharing the store see a prefix at
once; ``"evict"`` only writes through what the host cache takes (the plan's ``Offload``
hashes). Either way a block is queued once: a bounded set of the hashes already queued or
loaded from the store skips repeats, and the worker asks the store (``contains``) before it
writes. A failed save is counted by the worker; no store failure raises in the step.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from pagedkv.engine.kv_store import PagedKvStore

if TYPE_CHECKING:
    from pagedkv.offload import OffloadWorker

__all__ = ["SEEN_CAPACITY", "StoreSaves"]

# Hashes remembered as queued or loaded (least recently used forgotten first): 65,536 x ~100
# bytes of dict entry; a forgotten one costs a ``contains`` on the worker, never a second write.
SEEN_CAPACITY = 1 << 16


class StoreSaves:
    """Queues puts of ``caches``' blocks on ``worker`` (salt: ``identity``)."""

    def __init__(self, worker: OffloadWorker, identity: bytes, caches: PagedKvStore) -> None:
        self.worker = worker
        self.identity = identity
        self.caches = caches
        # [layers, 2, block_size, kv_heads, head_dim]: one block of every tensor, K and V.
        self.block_shape = (
            (len(caches.k_caches), 2, *caches.k_caches[0].shape[1:]) if caches.k_caches else (0,)
        )
        self.puts_submitted = 0  # blocks queued on the worker
        self.puts_dropped = 0  # refused by a full (or closed) worker queue: the step went on
        self.puts_repeated = 0  # skipped: already queued or loaded (the seen-set)
        self.blocks_saved_on_compute = 0  # of puts_submitted, by save_computed
        self._seen: collections.OrderedDict[int, None] = collections.OrderedDict()

    def seen_before(self, block_hash: int) -> bool:
        """The hash was queued or loaded (and is remembered): counted as a repeat."""
        if block_hash in self._seen:
            self._seen.move_to_end(block_hash)
            self.puts_repeated += 1
            return True
        return False

    def remember(self, block_hash: int) -> None:
        """The store holds (or will hold) ``block_hash``: never queue it again."""
        self._seen[block_hash] = None
        self._seen.move_to_end(block_hash)
        while len(self._seen) > SEEN_CAPACITY:
            self._seen.popitem(last=False)

    def submit(self, block_hash: int, payload: np.ndarray) -> bool:
        """Queue one put (a copy the caller made); never raises, never waits."""
        try:
            queued = self.worker.submit_put(block_hash, payload, extra_key=self.identity, if_absent=True)
        except Exception:  # noqa: BLE001 - a store put never fails the step
            queued = False
        if queued:
            self.puts_submitted += 1
            self.remember(block_hash)
        else:
            self.puts_dropped += 1
        return queued

    def save_computed(self, blocks: Sequence[int], hashes: Sequence[int]) -> None:
        """Save-on-compute: queue device ``blocks[i]`` (content hash ``hashes[i]``) unless
        queued or stored already. Runs right after the pass, before anything can write the
        blocks again (the next step's offloads, copies, loads). The K/V are copied here; the
        worker writes them off the critical path."""
        if not self.caches.k_caches:
            return
        picked: list[tuple[int, int]] = []
        chosen: set[int] = set()  # two rows completing the same block (equal prompts)
        for block, block_hash in zip(blocks, hashes, strict=True):
            if block_hash not in chosen and not self.seen_before(block_hash):
                chosen.add(block_hash)
                picked.append((block, block_hash))
        if not picked:
            return
        ids = np.array([b for b, _ in picked], dtype=np.intp)
        # [blocks, layers, 2, block_size, kv_heads, head_dim]: one gather per layer and K/V,
        # straight into the payloads (each block's payload is a contiguous slice).
        payloads = np.empty((len(picked), *self.block_shape), np.float32)
        for layer, (k, v) in enumerate(zip(self.caches.k_caches, self.caches.v_caches, strict=True)):
            np.take(k, ids, axis=0, out=payloads[:, layer, 0])
            np.take(v, ids, axis=0, out=payloads[:, layer, 1])
        for (_, block_hash), payload in zip(picked, payloads, strict=True):
            if self.submit(block_hash, payload):
                self.blocks_saved_on_compute += 1

    def close(self, timeout_s: float = 5.0) -> bool:
        """Run the queued puts (at most ``timeout_s``) and stop the worker."""
        return self.worker.close(timeout_s)
