"""WaitingOrder: which waiting sequence the scheduler admits next (``EngineConfig.scheduling``).

``"fcfs"`` admits the head of the waiting queue. ``"lpm"`` and ``"dfs"`` ask the simulator's
cache-aware queue (``pagedkv._core.CacheAwareQueue``, the Rust ``pagedkv_sim::CacheAwareQueue``,
docs/scheduling.md): an index over the waiting requests' block hashes, kept current from the
manager's KV events (drained into it in Rust, ``apply_manager_events``, no event object per
event), with the aging bound. The same queue, the same code as ``pagedkv simulate
--scheduling``.

Sequences preempted by recompute come back first under every policy (they hold the oldest
admissions), as under FCFS, unless the oldest waiting request has been passed over
``aging_bound`` times: then it goes first (``may_admit_other``), so the bound holds for every
request. A fork child (samples 1..n-1 of a request) shares its request's arrival rank.

The queue follows the device tier only: a host-cache or store hit still counts at admission
(``match_prefix``) but does not move a request forward in the order.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import pagedkv
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.sequence import Sequence
from pagedkv.engine.stats import EngineStats

if TYPE_CHECKING:
    from pagedkv._core import CacheAwareQueue

__all__ = ["WaitingOrder"]


class WaitingOrder:
    """The admission order over ``waiting`` (the scheduler's deque: sequences preempted by
    recompute at its front, then new requests in arrival order)."""

    def __init__(self, config: EngineConfig, kv: pagedkv.KvCacheManager) -> None:
        self.kv = kv
        self.block_size = config.block_size
        self.queue: CacheAwareQueue | None = None
        if config.scheduling != "fcfs":
            from pagedkv._core import CacheAwareQueue

            self.queue = CacheAwareQueue(config.scheduling, config.aging_bound)
        # The new requests in the queue, by sequence id.
        self._queued: dict[int, Sequence] = {}

    def sync(self) -> None:
        """Feed the manager's KV events recorded since the last call to the index."""
        if self.queue is not None:
            self.queue.apply_manager_events(self.kv)

    def add(self, seq: Sequence) -> None:
        """A new request's first sequence joined the waiting queue."""
        if self.queue is None:
            return
        self.sync()
        # Hashed once, in Rust (the hashes never become Python ints): the queue indexes them and
        # the admission takes them (``add_sequence(..., prompt_hashes=...)``) instead of hashing
        # the prompt again.
        seq.prompt_hashes = self.kv.prompt_hashes(seq.token_ids)
        max_hit_blocks = max(len(seq.token_ids) - 1, 0) // self.block_size
        seq.queue_rank = self.queue.push(seq.seq_id, seq.prompt_hashes, max_hit_blocks)
        self._queued[seq.seq_id] = seq

    def next(self, waiting: deque[Sequence]) -> Sequence:
        """The sequence to admit next (``waiting`` is not empty)."""
        head = waiting[0]
        if self.queue is None:
            return head
        if head.seq_id not in self._queued and self.queue.may_admit_other(head.queue_rank):
            return head  # preempted: it comes back first
        choice = self.queue.peek()
        return head if choice is None else self._queued[choice]

    def admitted(self, seq: Sequence) -> None:
        """``seq`` was admitted (its ``add_sequence`` succeeded)."""
        if self.queue is None:
            return
        if self._queued.pop(seq.seq_id, None) is not None:
            self.queue.admitted(seq.seq_id)
        else:
            self.queue.other_admitted(seq.queue_rank)
        self.sync()  # the admission's stored blocks, before the next choice

    def removed(self, seq: Sequence) -> None:
        """``seq`` left the waiting queue without being admitted (aborted, or failed)."""
        if self.queue is not None and self._queued.pop(seq.seq_id, None) is not None:
            self.queue.remove(seq.seq_id)

    def record(self, stats: EngineStats) -> None:
        """The aging bound and what the queue did, into the engine's stats."""
        if self.queue is None:
            return
        s = self.queue.stats()
        stats.aging_bound = self.queue.aging_bound
        stats.max_passed_over = s["max_passed_over"]
        stats.forced_admissions = s["forced_admissions"]
