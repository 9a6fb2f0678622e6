"""StoreLookup: the scheduler's side of the store (``EngineConfig(offload=store)``).

Admission asks the store for the prompt's blocks after the device and host-cache hits, and
plans the admission on what it returns: how many tokens are served decides how many are
scheduled. So the look-up happens while the scheduler plans, and the blocks it returns travel
in the plan (``StoreHits``) to the model runner, which writes them into the fresh device
blocks. The store API offers no cheaper way to know what a later read will return (a
``contains`` answer can be evicted before the read), and a plan must never promise K/V it
cannot deliver; vLLM's KV connectors split the same way (a scheduler-side look-up, a
worker-side load).

A look-up waits for the ``OffloadWorker``'s thread until a deadline: what arrives in time,
whole and of the engine's block shape, from the first block on, is a hit; everything else is a
miss, recomputed by the pass (counted in ``deadline_misses`` when the deadline cut the load
short). The deadline is ``EngineConfig.offload_deadline_s`` when it is a number; by default
(None) it follows the store: ``num_blocks * LATENCY_MARGIN * get_latency_s``, the worker's
measured seconds per get (a moving average, so recomputed as the load's gets finish), within
``[MIN_DEADLINE_S, MAX_DEADLINE_S]``. A fixed deadline that serves a whole prompt on a
quiet machine serves part of it on a busy one, where each get takes longer
(tests/offload/test_shared_store.py); the measured latency scales the wait with the store and
the machine as they are. Before the worker has timed a get, the first
look-up waits up to ``MAX_DEADLINE_S`` for its first get to finish (the measurement); a store
that answers none in that time is not waited for again (``MIN_DEADLINE_S``) until a get is
timed. The first waiting prompts' blocks are prefetched while the pass runs (``prefetch``), so
that their admission finds them loaded. No store failure raises: a corrupted entry, an
unreachable or restarted Redis are misses.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from pagedkv.offload import OffloadWorker
    from pagedkv.offload.worker import Prefetch

__all__ = ["LATENCY_MARGIN", "MAX_DEADLINE_S", "MIN_DEADLINE_S", "PREFETCH_DEPTH", "StoreLookup"]

# Waiting prompts whose store blocks are prefetched: the next admissions.
PREFETCH_DEPTH = 2
# The adaptive deadline (offload_deadline_s=None): a look-up waits for its blocks at the store's
# measured seconds per get, with this margin for the gets slower than the average ...
LATENCY_MARGIN = 2.0
# ... at least this long (the fixed deadline of earlier versions: a round trip on a busy
# machine) and at most this long (a step never stalls longer on the store).
MIN_DEADLINE_S = 0.05
MAX_DEADLINE_S = 2.0


class StoreLookup:
    """Store look-ups and prefetches through ``worker``, keyed by the engine's layout
    ``identity`` (the salt); a hit is a float32 payload of ``block_shape`` (``[layers, 2,
    block_size, kv_heads, head_dim]``). ``deadline_s``: a fixed deadline per look-up, or None
    for the adaptive one (module docs)."""

    def __init__(
        self,
        worker: OffloadWorker,
        identity: bytes,
        block_shape: tuple[int, ...],
        block_size: int,
        deadline_s: float | None = None,
    ) -> None:
        self.worker = worker
        self.identity = identity
        self.block_shape = block_shape
        self.block_size = block_size
        self.deadline_s = deadline_s
        # seq_id -> (the hashes asked for, the prefetch): the first waiting prompts' blocks.
        self._prefetched: dict[int, tuple[set[int], Prefetch]] = {}
        self.prefetched_blocks = 0  # store hits a prefetch had loaded
        self.store_hit_blocks = 0
        self.store_misses = 0
        self.deadline_misses = 0  # look-ups whose deadline passed before their load finished
        self._unresponsive = False  # the first measurement waited in vain (module docs)

    def prefetch(self, kv: Any, waiting: list[tuple[int, np.ndarray]]) -> None:
        """Start loading the store blocks the first waiting prompts will look up (``(seq_id,
        tokens)`` each, in queue order), so that their admission finds them loaded; prefetches
        of sequences no longer among them are dropped (memory stays bounded)."""
        wanted = {seq_id for seq_id, _ in waiting}
        for seq_id in [s for s in self._prefetched if s not in wanted]:
            self._prefetched.pop(seq_id)[1].take(0.0)
        bs = self.block_size
        for seq_id, tokens in waiting:
            if seq_id in self._prefetched:
                continue
            hit, last = kv.match_prefix(tokens), (len(tokens) - 1) // bs
            hashes = kv.prefix_block_hashes(tokens)[hit // bs : last] if hit // bs < last else []
            try:
                self._prefetched[seq_id] = (
                    set(hashes),
                    self.worker.prefetch(hashes, extra_key=self.identity),
                )
            except Exception:  # noqa: BLE001 - a store failure is a miss, never an error in the step
                continue

    def lookup(self, block_hashes: list[int], seq_id: int | None = None) -> list[tuple[int, np.ndarray]]:
        """``(hash, payload)`` of the leading ``block_hashes`` the store returns within the
        deadline (from ``seq_id``'s prefetch when it covers them), whole and of this engine's
        block shape; stops at the first miss."""
        pending = self._prefetched.pop(seq_id, None) if seq_id is not None else None
        if not block_hashes:
            return []
        try:
            if pending is not None and set(block_hashes) <= pending[0]:
                found = self._collect(pending[1], len(block_hashes))
                self.prefetched_blocks += sum(h in found for h in block_hashes)
            else:
                if pending is not None:
                    pending[1].take(0.0)
                load = self.worker.prefetch(block_hashes, extra_key=self.identity)
                found = self._collect(load, len(block_hashes))
        except Exception:  # noqa: BLE001 - a store failure is a miss, never an error in the step
            found = {}
        out = []
        for h in block_hashes:
            payload = found.get(h)
            if not (
                isinstance(payload, np.ndarray)
                and payload.dtype == np.float32
                and payload.shape == self.block_shape
            ):
                break
            out.append((h, payload))
        self.store_hit_blocks += len(out)
        self.store_misses += len(block_hashes) - len(out)
        return out

    def deadline_for(self, num_blocks: int) -> float | None:
        """The seconds a look-up of ``num_blocks`` blocks waits (None: adaptive and not
        measured yet)."""
        if self.deadline_s is not None:
            return self.deadline_s
        latency = self.worker.get_latency_s
        if latency is None:
            return MIN_DEADLINE_S if self._unresponsive else None
        return min(MAX_DEADLINE_S, max(MIN_DEADLINE_S, num_blocks * LATENCY_MARGIN * latency))

    def _collect(self, load: Prefetch, num_blocks: int) -> dict[int, Any]:
        """What ``load`` brings by its deadline (then ended; a miss counted when it was cut
        short). An adaptive deadline is recomputed as each get finishes: the wait follows the
        store's pace during the load too, within ``MAX_DEADLINE_S`` in all."""
        start = time.monotonic()
        if self.deadline_for(num_blocks) is None:
            # Measure the store first: wait for the load's first get (or its end).
            load.wait(MAX_DEADLINE_S)
            if self.deadline_for(num_blocks) is None:  # no get answered in MAX_DEADLINE_S
                self._unresponsive = True
        while not load.done:
            left = start + (self.deadline_for(num_blocks) or MIN_DEADLINE_S) - time.monotonic()
            if left <= 0:
                break
            load.wait(left)
        found = load.take(0.0)
        if load.abandoned:
            self.deadline_misses += 1
        return found

    def close(self) -> None:
        """Drop the pending prefetches (the worker stops their loads where they are)."""
        for _, pending in self._prefetched.values():
            pending.take(0.0)
        self._prefetched.clear()
