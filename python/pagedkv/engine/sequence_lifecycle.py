"""What happens to the scheduler's sequences outside its planning of a step: the engine's calls
after a pass (``computed_rows``, ``rollback``, ``truncate_rejected``), forks, finishing,
aborting, and preemption (which ``Scheduler.schedule`` also decides, in its steps 2 and 3).

``SequenceLifecycle`` is ``Scheduler``'s base (scheduler.py): these operations move a sequence
between the queues and release what it holds, the planning of a step in scheduler.py decides when
they run. The attributes below are the scheduler's state, set by ``Scheduler.__init__``.
"""

from __future__ import annotations

from collections import deque

import numpy as np

import pagedkv
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.residual_slots import ResidualSlots
from pagedkv.engine.scheduled_batch import CopyResidual, DataOp, ReopenBlock, Row, SwapOut
from pagedkv.engine.sequence import SeqStatus, Sequence
from pagedkv.engine.stats import EngineStats
from pagedkv.engine.waiting_order import WaitingOrder

__all__ = ["SequenceLifecycle"]


class SequenceLifecycle:
    """The scheduler's operations on one sequence's state (see the module docs)."""

    config: EngineConfig
    kv: pagedkv.KvCacheManager
    num_groups: int
    stats: EngineStats
    waiting: deque[Sequence]
    order: WaitingOrder
    running: list[Sequence]
    swapped: list[Sequence]
    slots: ResidualSlots | None
    host_slots: ResidualSlots | None
    _admissions: int
    _ops: list[DataOp]
    _appended: set[int]
    _pending: list[DataOp]
    _swap_reserve: dict[int, int]

    def _next_admission(self) -> int:
        """The admission rank of the sequence that starts running now (admission order)."""
        self._admissions += 1
        return self._admissions - 1

    def computed_rows(self, rows: list[Row]) -> None:
        """The pass wrote the K/V of every row."""
        for row in rows:
            if row.decode:
                self.stats.decode_tokens += row.end - row.start
            else:
                self.stats.prefill_tokens += row.end - row.start
        self._appended = set()

    def rollback(self, rows: list[Row]) -> None:
        """The pass failed: its K/V may be unwritten, yet the watermark covers them (and a request
        admitted in this step may hold them as its hit). Releasing every block of the batch's
        sequences tail first takes each block held by them alone out of the prefix index, so
        that no later request hits it; the caller then fails their requests."""
        for seq in {id(r.seq): r.seq for r in rows}.values():
            if seq.seq_id in self.kv and not self.kv.is_swapped_out(seq.seq_id):
                self.kv.truncate(seq.seq_id, 0)
            seq.draft_ids = []
        self._appended = set()

    def truncate_rejected(self, seq: Sequence) -> None:
        """After a speculative pass: drop the K/V of the rejected drafts (the manager holds every
        token but the last sampled one)."""
        keep = len(seq.token_ids) - 1
        if seq.status is SeqStatus.RUNNING and self.kv.num_tokens(seq.seq_id) > keep:
            self._reopen(seq, self.kv.num_tokens(seq.seq_id), keep)
            self.kv.truncate(seq.seq_id, keep)
        seq.draft_ids = []

    def _reopen(self, seq: Sequence, written: int, keep: int) -> None:
        """int4: a truncation from ``written`` (every token's K/V written) to ``keep`` tokens that
        cuts into a block the writes sealed reopens it: its kept tokens go back to the residual
        slot (docs/quantized_kv.md, "Truncation")."""
        bs = self.config.block_size
        block, count = divmod(keep, bs)
        if self.slots is None or count == 0 or written < (block + 1) * bs:
            return  # no residual, a block boundary, or the block is still open
        if self.num_groups > 1:
            tables = [self.kv.block_table(seq.seq_id, group=g) for g in range(self.num_groups)]
        else:
            tables = [self.kv.block_table(seq.seq_id)]
        blocks = tuple(int(t[block]) for t in tables)
        self._pending.append(ReopenBlock(self.slots.slot(seq.seq_id), count, blocks))
        self.stats.residual_reopens += 1

    def fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """The samples 1..n-1 of ``parent``'s request share its blocks from now on (an int4
        cache: each gets a copy of the parent's residual slot, in the next plan)."""
        pairs = []
        for child in children:
            self.kv.fork(parent.seq_id, child.seq_id)
            if self.slots is not None:
                pairs.append(self.slots.fork(parent.seq_id, child.seq_id))
            child.status, child.admitted = SeqStatus.RUNNING, self._next_admission()
            child.queue_rank, child.prompt_hashes = parent.queue_rank, parent.prompt_hashes
            self.running.append(child)
        if pairs:
            self._pending.append(CopyResidual(np.array(pairs, np.int32)))

    def _release_slots(self, seq: Sequence) -> None:
        """Whatever residual slots ``seq`` holds, device and host."""
        for slots in (self.slots, self.host_slots):
            if slots is not None:
                slots.release(seq.seq_id)
        self._swap_reserve.pop(seq.seq_id, None)

    def finish(self, seq: Sequence) -> None:
        seq.status = SeqStatus.FINISHED
        self.kv.free(seq.seq_id)
        self._release_slots(seq)
        self.running.remove(seq)

    def abort(self, seq: Sequence) -> None:
        """Finish ``seq`` wherever it is (waiting, running, swapped, or a fork child not yet in
        any queue), releasing whatever blocks it holds."""
        for queue in (self.running, self.swapped, self.waiting):
            if seq in queue:
                queue.remove(seq)
        self.order.removed(seq)
        if seq.seq_id in self.kv:
            self.kv.free(seq.seq_id)
        self._release_slots(seq)
        seq.status = SeqStatus.FINISHED

    def preempt(self, seq: Sequence) -> None:
        if seq.seq_id in self._appended:
            # Its tokens appended this step are "computed" in the manager, but no pass will
            # write them now: drop them, so that the watermark covers written K/V only (a block
            # they filled leaves the prefix index) and the sequence decodes them again later.
            self.kv.truncate(seq.seq_id, len(seq.token_ids) - 1)
            self._appended.discard(seq.seq_id)
        seq.draft_ids = []
        host_slot_free = self.host_slots is None or self.host_slots.can_take(1)
        if self.config.preemption == "swap" and host_slot_free:
            try:
                mapping = self.kv.swap_out([seq.seq_id])
            except pagedkv.PagedKvError:
                mapping = None
            if mapping is not None:
                residual = self._swap_out_residual(seq)
                if len(mapping) or len(residual):
                    # Before anything writes those blocks (or that slot) again.
                    self._ops.append(SwapOut(mapping, residual))
                self.running.remove(seq)
                seq.status = SeqStatus.SWAPPED
                self.swapped.append(seq)
                self.stats.swap_preemptions += 1
                return
        self.kv.free(seq.seq_id)
        self._release_slots(seq)
        self.running.remove(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.stats.recompute_preemptions += 1

    def _swap_out_residual(self, seq: Sequence) -> np.ndarray:
        """An int4 cache: ``seq``'s residual slot goes to a host slot (its reservations are
        released and taken again on swap-in); (device slot, host slot)."""
        if self.slots is None or self.host_slots is None:
            return np.zeros((0, 2), np.int32)
        device = self.slots.slot(seq.seq_id)
        self._swap_reserve[seq.seq_id] = self.slots.reserved(seq.seq_id)
        self.slots.release(seq.seq_id)
        host = self.host_slots.take(seq.seq_id)
        return np.array([[device, host]], np.int32)
