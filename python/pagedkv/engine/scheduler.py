"""The scheduler: which sequences hold blocks, which run in the next forward pass, and which rows
of their tokens it computes.

Three queues, as in vLLM and nano-vllm: ``waiting`` (not in the KV manager: new, or preempted by
recompute), ``running`` (blocks on the device) and ``swapped`` (blocks in the host tier). One
``schedule()``:

1. swaps back in the sequences preempted by swap (oldest first) while blocks allow;
2. appends every decoding sequence's last sampled token (``append_tokens_batch``, one crossing),
   preempting the most recently admitted sequence (recompute or swap) while blocks run short;
3. admits waiting requests first-come-first-served while blocks allow: ``add_sequence`` returns the
   prefix-cache hit, and only the uncached suffix is prefilled;
4. spends the per-step token budget: one row per decoding sequence, then prefill chunks in
   admission order (chunked prefill);
5. takes the manager's pending copy-on-write copies for the model runner to execute first.

Prefix-cache hits are trusted only on computed blocks (``ComputedBlocks``): a hit is trusted up to
the first incomplete block; an incomplete hit block that nobody else holds is recomputed in place,
and one that another live sequence is still filling defers the admission to a later step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

import pagedkv
from pagedkv.engine.computed_blocks import ComputedBlocks
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.kv_store import PagedKvStore
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.sequence import SeqStatus, Sequence
from pagedkv.engine.stats import EngineStats
from pagedkv.errors import InvalidArgumentError, OutOfBlocksError

__all__ = ["Row", "ScheduledBatch", "Scheduler"]


@dataclass(frozen=True)
class Row:
    """Positions ``start..end`` of ``seq``'s tokens, computed by this pass."""

    seq: Sequence
    start: int
    end: int

    @property
    def samples(self) -> bool:
        """The row ends the sequence's known tokens: its last logits give the next token."""
        return self.end == len(self.seq.token_ids)

    @property
    def is_decode(self) -> bool:
        return bool(self.seq.output_ids) and self.end - self.start == 1 and self.samples


@dataclass(frozen=True)
class ScheduledBatch:
    rows: list[Row]
    copy_ops: np.ndarray  # (src, dst) block copies to execute before the pass


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        max_model_len: int,
        kv: pagedkv.KvCacheManager,
        store: PagedKvStore,
        stats: EngineStats,
    ) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.kv = kv
        self.store = store  # swap data moves happen when the manager decides them
        self.stats = stats
        self.computed = ComputedBlocks(config.num_blocks, config.block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self._admissions = 0
        # Sequences whose admission failed for a reason of their own (not a lack of blocks): the
        # engine finishes their requests with an error status.
        self.failed: list[tuple[Sequence, Exception]] = []

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """InvalidArgumentError unless a request can run here alone: its prompt leaves room in
        the context and its n samples at full length fit the pool (sharing the full prompt
        blocks), so that admission can never wait for it forever."""
        if num_prompt_tokens >= self.max_model_len:
            raise InvalidArgumentError(
                f"the prompt has {num_prompt_tokens} tokens; the model's context holds "
                f"{self.max_model_len} (prompt plus at least one generated token)"
            )
        bs = self.config.block_size
        total = min(num_prompt_tokens + params.max_tokens, self.max_model_len)
        shared = num_prompt_tokens // bs  # full prompt blocks the n samples share
        needed = shared + params.n * (-(-(total - shared * bs) // bs))
        if needed > self.config.num_blocks:
            raise InvalidArgumentError(
                f"n={params.n} samples of {total} tokens need {needed} blocks at most; the pool has "
                f"{self.config.num_blocks}"
            )

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # ---- one step -------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        self._swap_in()
        self._append_decode_tokens()
        self._admit()
        rows = self._plan_rows()
        ops = self.kv.take_copy_ops() if rows else np.zeros((0, 2), np.int32)
        self.computed.copied(ops)
        self.stats.cow_copies += len(ops)
        return ScheduledBatch(rows, ops)

    def _swap_in(self) -> None:
        while self.swapped:
            seq = min(self.swapped, key=lambda s: s.admitted)
            try:
                mapping = self.kv.swap_in([seq.seq_id])
            except OutOfBlocksError:
                return
            self.store.swap_in(mapping)
            self.swapped.remove(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            # Fresh device blocks: complete up to what the sequence had computed, stale after it.
            table = self.kv.block_table(seq.seq_id)
            self.computed.invalidate(table[seq.num_computed // self.config.block_size :])
            self.computed.mark_computed(table, 0, seq.num_computed)

    def _append_decode_tokens(self) -> None:
        while True:
            decoding = [s for s in self.running if s.output_ids and s.num_in_kv == len(s.token_ids) - 1]
            if not decoding:
                return
            try:
                self.kv.append_tokens_batch(
                    [s.seq_id for s in decoding],
                    np.array([s.token_ids[-1] for s in decoding], dtype=np.int64),
                )
            except OutOfBlocksError:
                self.preempt(max(self.running, key=lambda s: s.admitted))
                continue
            for s in decoding:
                s.num_in_kv += 1
                # The last block now holds a token whose K/V the next pass computes; it is fresh,
                # or a copy-on-write copy the manager may already have indexed when it filled up.
                self.computed.invalidate(self.kv.block_table(s.seq_id)[-1:])
            return

    def _reserved_slots(self) -> int:
        return self.max_model_len * (len(self.running) + len(self.swapped))

    def _admit(self) -> None:
        c = self.config
        if self.swapped:
            return  # sequences waiting to swap back in go first
        while self.waiting and len(self.running) < c.max_num_seqs:
            seq = self.waiting[0]
            if c.reservation == "contiguous" and (
                self._reserved_slots() + self.max_model_len > c.num_blocks * c.block_size
            ):
                return
            # Leave a small watermark so that admitting does not force the next append to preempt.
            watermark = c.admission_watermark_blocks
            if watermark is None:
                watermark = max(1, c.num_blocks // 100)
            blocks = -(-len(seq.token_ids) // c.block_size) + (watermark if self.running else 0)
            if blocks > self.kv.num_free_blocks:
                return
            try:
                hit = self.kv.add_sequence(seq.seq_id, np.array(seq.token_ids, dtype=np.int64))
            except OutOfBlocksError:
                return
            except pagedkv.PagedKvError as error:
                self.waiting.popleft()
                self.failed.append((seq, error))
                continue
            table = self.kv.block_table(seq.seq_id)
            hit_blocks = hit // c.block_size
            # The blocks past the hit are fresh: whatever they held belongs to their previous
            # owner. add_sequence has already indexed the full ones under this prompt's hashes, so
            # they must be marked incomplete now, before a deferral frees them into the cache.
            self.computed.invalidate(table[hit_blocks:])
            trusted = self.computed.trusted_blocks(table, hit_blocks)
            stale = table[trusted:hit_blocks]
            if any(self.kv.refcount(int(b)) > 1 for b in stale):
                # Another live sequence is still computing these blocks: come back next step.
                self.kv.free(seq.seq_id)
                self.stats.deferred_admissions += 1
                return
            self.computed.invalidate(stale)  # revived incomplete blocks: recomputed in place
            self.waiting.popleft()
            seq.num_in_kv = len(seq.token_ids)
            seq.num_computed = min(trusted * c.block_size, seq.num_in_kv - 1)  # the last row gives logits
            seq.status = SeqStatus.RUNNING
            seq.admitted = self._next_admission()
            self.running.append(seq)
            self.stats.prefix_hit_tokens += seq.num_computed
            if seq.index == 0 and not seq.request.forked:
                seq.request.cached_tokens = seq.num_computed

    def _next_admission(self) -> int:
        self._admissions += 1
        return self._admissions - 1

    def _plan_rows(self) -> list[Row]:
        """This pass's rows, within the token budget: decode rows first, then prefill chunks."""
        budget = self.config.max_num_batched_tokens
        rows = []
        for s in sorted(self.running, key=lambda s: s.admitted):
            if s.output_ids and s.num_computed == s.num_in_kv - 1 == len(s.token_ids) - 1:
                rows.append(Row(s, s.num_computed, s.num_in_kv))
                budget -= 1
        for s in sorted(self.running, key=lambda s: s.admitted):
            remaining = s.num_in_kv - s.num_computed
            if remaining <= 0 or (s.output_ids and remaining == 1 and s.num_in_kv == len(s.token_ids)):
                continue
            if budget <= 0:
                break
            chunk = remaining if not self.config.enable_chunked_prefill else min(remaining, budget)
            if chunk > budget and rows:
                break
            rows.append(Row(s, s.num_computed, s.num_computed + chunk))
            budget -= chunk
        return rows

    # ---- after the forward pass -----------------------------------------------------------

    def computed_rows(self, rows: list[Row]) -> None:
        """The pass wrote the K/V of every row."""
        for row in rows:
            if row.is_decode:
                self.stats.decode_tokens += 1
            else:
                self.stats.prefill_tokens += row.end - row.start
            row.seq.num_computed = row.end
            self.computed.mark_computed(self.kv.block_table(row.seq.seq_id), row.start, row.end)

    def fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """The samples 1..n-1 of ``parent``'s request share its blocks from now on."""
        for child in children:
            self.kv.fork(parent.seq_id, child.seq_id)
            child.num_in_kv, child.num_computed = parent.num_in_kv, parent.num_computed
            child.status, child.admitted = SeqStatus.RUNNING, self._next_admission()
            self.running.append(child)

    def finish(self, seq: Sequence) -> None:
        seq.status = SeqStatus.FINISHED
        self.kv.free(seq.seq_id)
        self.running.remove(seq)

    def abort(self, seq: Sequence) -> None:
        """Finish ``seq`` wherever it is (waiting, running, swapped, or a fork child not yet in
        any queue), releasing whatever blocks it holds."""
        for queue in (self.running, self.swapped, self.waiting):
            if seq in queue:
                queue.remove(seq)
        if seq.seq_id in self.kv:
            self.kv.free(seq.seq_id)
        seq.status = SeqStatus.FINISHED

    def preempt(self, seq: Sequence) -> None:
        if self.config.preemption == "swap":
            try:
                mapping = self.kv.swap_out([seq.seq_id])
            except pagedkv.PagedKvError:
                mapping = None
            if mapping is not None:
                self.store.swap_out(mapping)
                self.running.remove(seq)
                seq.status = SeqStatus.SWAPPED
                self.swapped.append(seq)
                self.stats.swap_preemptions += 1
                return
        self.kv.free(seq.seq_id)
        self.running.remove(seq)
        seq.status = SeqStatus.WAITING
        seq.num_in_kv = seq.num_computed = 0
        self.waiting.appendleft(seq)
        self.stats.recompute_preemptions += 1
