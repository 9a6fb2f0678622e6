"""The scheduler: which sequences hold blocks, which run in the next forward pass, and which rows
of their tokens it computes.

Three queues, as in vLLM and nano-vllm: ``waiting`` (not in the KV manager: new, or preempted by
recompute), ``running`` (blocks on the device) and ``swapped`` (blocks in the host tier). One
``schedule()``:

1. swaps back in the sequences preempted by swap (oldest first) while blocks allow;
2. appends every decoding sequence's last sampled token, and its speculative drafts
   (``append_tokens_batch``), preempting the most recently admitted sequence (recompute or swap)
   while blocks run short;
3. spends the per-step token budget: one row per decoding sequence (plus its drafts), then the
   next prefill chunk of each running sequence still prefilling, in admission order
   (``advance_computed``);
4. admits waiting requests first-come-first-served while blocks and budget allow: ``match_prefix``
   gives the prefix-cache hit without side effects, and ``add_sequence(..., num_scheduled=chunk)``
   schedules the first chunk of the uncached suffix;
5. takes the manager's pending copy-on-write copies for the model runner to execute first.

With offload tiers (``EngineConfig.offload_blocks``, ``offload_tiers.py``) the offload ops a
step records run as soon as they are recorded (after a swap-in, and before the copies), the
load ops and the store's blocks of new admissions run in the model runner after the copies;
admission looks the prompt's next blocks up in the store after the device and host hits.

Which K/V exist is the manager's computed watermark (``num_computed_tokens``), never shadowed
here. Like vLLM's scheduler, the watermark moves when a chunk is *scheduled*: the pass that
computes it runs right after ``schedule()``, and attention writes each layer's K/V before reading
it, so a request admitted in the same step may hit those blocks. That is sound only if every
scheduled chunk is executed, hence: nothing is preempted after rows are planned (preemption
happens in step 2, and a sequence preempted there first truncates the tokens appended for this
step, so the watermark drops back to what earlier passes wrote), and a failed pass rolls its
sequences back (``rollback``) before their requests fail. The manager caps every hit below the
prompt's length, so the last prompt token is always computed and gives the first logits.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

import pagedkv
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.kv_store import PagedKvStore
from pagedkv.engine.ngram_proposer import propose_ngram_drafts
from pagedkv.engine.offload_tiers import OffloadTiers
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.sequence import SeqStatus, Sequence
from pagedkv.engine.stats import EngineStats
from pagedkv.errors import InvalidArgumentError, OutOfBlocksError

__all__ = ["PREFETCH_DEPTH", "Row", "ScheduledBatch", "Scheduler"]

# Waiting prompts whose store blocks are prefetched (offload tiers): the next admissions.
PREFETCH_DEPTH = 2


@dataclass(frozen=True)
class Row:
    """Positions ``start..end`` of ``seq``'s tokens (``token_ids`` then ``draft_ids``), computed
    by this pass. A decode row starts at the last sampled token and covers the drafts after it."""

    seq: Sequence
    start: int
    end: int
    decode: bool = False

    @property
    def samples(self) -> bool:
        """The row ends the sequence's known tokens: its logits give the next token(s)."""
        return self.end == len(self.seq.token_ids) + len(self.seq.draft_ids)

    @property
    def num_logits(self) -> int:
        """Rows whose logits the engine needs: the last one, and one per draft before it."""
        return 1 + len(self.seq.draft_ids) if self.decode else 1


@dataclass(frozen=True)
class ScheduledBatch:
    rows: list[Row]
    copy_ops: np.ndarray  # (src, dst) block copies to execute before the pass
    # (host_block, device_block) offload-tier hits to load after the copies
    load_ops: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int32))
    # (device_block, payload [layers, 2, block_size, heads, head_dim]) store hits, after the loads
    store_writes: list[tuple[int, np.ndarray]] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        max_model_len: int,
        kv: pagedkv.KvCacheManager,
        store: PagedKvStore,
        stats: EngineStats,
        tiers: OffloadTiers | None = None,
    ) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.kv = kv
        self.store = store  # swap data moves happen when the manager decides them
        self.tiers = tiers
        self._store_writes: list[tuple[int, np.ndarray]] = []
        self.stats = stats
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
        total = min(num_prompt_tokens + params.max_tokens, self.max_model_len)
        needed = self.blocks_to_fit(num_prompt_tokens, params)
        if needed > self.config.num_blocks:
            raise InvalidArgumentError(
                f"n={params.n} samples of {total} tokens need {needed} blocks at most"
                + (f" over {groups} KV groups" if (groups := self.store.layout.num_groups) > 1 else "")
                + f"; the pool has {self.config.num_blocks}"
            )

    def blocks_to_fit(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The blocks a request alone needs at most, over every KV group: the shared full prompt
        blocks plus each sample's own blocks up to its full length, in every group. A
        sliding-window group holds less once its window has passed (the prompt until it is
        computed, then the window), but the manager refuses any sequence whose tokens could not
        fit every group's table at once (InvalidArgumentError from an append), so the bound
        counts every group in full: a request within it never meets that refusal."""
        bs = self.config.block_size
        total = min(num_prompt_tokens + params.max_tokens, self.max_model_len)
        shared = num_prompt_tokens // bs  # full prompt blocks the n samples share
        full = shared + params.n * (-(-(total - shared * bs) // bs))
        return self.store.layout.num_groups * full

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # ---- one step -------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        self._appended: set[int] = set()  # seq ids whose append this step no pass has written yet
        self._swap_in()
        self._append_decode_tokens()
        budget = self.config.max_num_batched_tokens
        rows = self._plan_running(budget)
        budget -= sum(r.end - r.start for r in rows)
        self._admit(rows, budget)
        if self.tiers is not None and self.tiers.worker is not None:
            # The next admissions' store blocks load while this step's pass runs.
            waiting = [
                (s.seq_id, np.array(s.token_ids, dtype=np.int64)) for s in list(self.waiting)[:PREFETCH_DEPTH]
            ]
            self.tiers.prefetch(self.kv, waiting)
        self._offload()
        ops = self.kv.take_copy_ops() if rows else np.zeros((0, 2), np.int32)
        self.stats.cow_copies += len(ops)
        if self.tiers is None:
            return ScheduledBatch(rows, ops)
        loads = self.kv.take_load_ops()
        writes, self._store_writes = self._store_writes, []
        return ScheduledBatch(rows, ops, loads, writes)

    def _offload(self) -> None:
        """Run the offload ops recorded so far: before anything writes the device blocks they
        read (a swap-in's copies, this step's copies, loads and pass)."""
        if self.tiers is not None:
            self.tiers.offload(self.kv)

    def _swap_in(self) -> None:
        while self.swapped:
            seq = min(self.swapped, key=lambda s: s.admitted)
            try:
                mapping = self.kv.swap_in([seq.seq_id])
            except OutOfBlocksError:
                return
            self._offload()
            self.store.swap_in(mapping)
            self.swapped.remove(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)

    def _needs_append(self, seq: Sequence) -> bool:
        """A decoding sequence whose last sampled token is not in the manager yet."""
        return bool(seq.output_ids) and self.kv.num_tokens(seq.seq_id) == len(seq.token_ids) - 1

    def _append_decode_tokens(self) -> None:
        speculate = self.config.speculative_ngram > 0
        while True:
            decoding = sorted((s for s in self.running if self._needs_append(s)), key=lambda s: s.admitted)
            if not decoding:
                return
            for s in decoding:
                s.draft_ids = []
            if speculate:
                self._propose(decoding)
            groups: dict[int, list[Sequence]] = {}
            for s in decoding:
                groups.setdefault(len(s.draft_ids), []).append(s)
            try:
                for num_drafts, group in sorted(groups.items()):
                    tokens = [t for s in group for t in (s.token_ids[-1], *s.draft_ids)]
                    self.kv.append_tokens_batch(
                        [s.seq_id for s in group], np.array(tokens, dtype=np.int64), num_tokens=1 + num_drafts
                    )
                    self._appended.update(s.seq_id for s in group)
            except OutOfBlocksError:
                if speculate and any(s.draft_ids for s in decoding):
                    speculate = False  # drafts never cost a preemption: retry without them
                    continue
                self.preempt(max(self.running, key=lambda s: s.admitted))
                continue
            return

    def _propose(self, decoding: list[Sequence]) -> None:
        """Prompt-lookup drafts for the greedy decoding sequences, within the token budget (one
        row per decoding sequence comes first), the request's max_tokens and the context."""
        budget = self.config.max_num_batched_tokens - len(decoding)
        for s in decoding:
            params = s.request.params
            room = min(
                self.config.speculative_ngram,
                budget,
                params.max_tokens - len(s.output_ids) - 1,  # the pass also samples one token
                self.max_model_len - 1 - len(s.token_ids),
            )
            if room <= 0 or not params.greedy:
                continue
            s.draft_ids = propose_ngram_drafts(s.token_ids, room)
            budget -= len(s.draft_ids)

    def _plan_running(self, budget: int) -> list[Row]:
        """Decode rows first (always: their tokens are appended), then the next prefill chunk of
        each running sequence still prefilling, in admission order; chunks are scheduled in the
        manager (``advance_computed``) as they are planned."""
        rows = []
        by_admission = sorted(self.running, key=lambda s: s.admitted)
        for s in by_admission:
            if s.seq_id in self._appended:
                start = len(s.token_ids) - 1
                rows.append(Row(s, start, start + 1 + len(s.draft_ids), decode=True))
                budget -= 1 + len(s.draft_ids)
        for s in by_admission:
            computed = self.kv.num_computed_tokens(s.seq_id)
            remaining = self.kv.num_tokens(s.seq_id) - computed
            if remaining <= 0 or s.seq_id in self._appended:
                continue
            chunk = self._chunk(remaining, budget, bool(rows))
            if chunk == 0:
                break
            self.kv.advance_computed([s.seq_id], chunk)
            rows.append(Row(s, computed, computed + chunk))
            budget -= chunk
        return rows

    def _chunk(self, remaining: int, budget: int, have_rows: bool) -> int:
        """Tokens of a prefill to schedule now: all of them without chunked prefill (even past
        the budget when nothing else runs, or it would never run), else what the budget allows."""
        if budget <= 0:
            return 0
        if not self.config.enable_chunked_prefill:
            return remaining if remaining <= budget or not have_rows else 0
        return min(remaining, budget)

    def _reserved_slots(self) -> int:
        """Slots the contiguous reservation holds: max_model_len per sequence in every KV group."""
        return self.store.layout.num_groups * self.max_model_len * (len(self.running) + len(self.swapped))

    def _admit(self, rows: list[Row], budget: int) -> None:
        c = self.config
        if self.swapped:
            return  # sequences waiting to swap back in go first
        while self.waiting and len(self.running) < c.max_num_seqs:
            seq = self.waiting[0]
            if c.reservation == "contiguous" and (
                self._reserved_slots() + self.store.layout.num_groups * self.max_model_len
                > c.num_blocks * c.block_size
            ):
                return
            # Leave a small watermark so that admitting does not force the next append to preempt.
            watermark = c.admission_watermark_blocks
            if watermark is None:
                watermark = max(1, c.num_blocks // 100)
            # The prompt's blocks in every KV group (the manager allocates the whole prompt in
            # each; add_sequence is the exact check, all or nothing, and refuses what is short).
            prompt_blocks = self.store.layout.num_groups * -(-len(seq.token_ids) // c.block_size)
            blocks = prompt_blocks + (watermark if self.running else 0)
            if blocks > self.kv.num_free_blocks:
                return
            tokens = np.array(seq.token_ids, dtype=np.int64)
            try:
                hit = self.kv.match_prefix(tokens) if c.enable_prefix_caching else 0
                stored = self._store_hits(seq.seq_id, tokens, hit, budget)
                served = hit + len(stored) * c.block_size
                chunk = self._chunk(len(tokens) - served, budget, bool(rows))
                if chunk == 0:
                    return
                hit = self.kv.add_sequence(seq.seq_id, tokens, num_scheduled=served - hit + chunk)
            except OutOfBlocksError:
                return
            except pagedkv.PagedKvError as error:
                self.waiting.popleft()
                self.failed.append((seq, error))
                continue
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            seq.admitted = self._next_admission()
            self.running.append(seq)
            if stored:
                table = self.kv.block_table(seq.seq_id)
                first = hit // c.block_size
                self._store_writes.extend(
                    (int(table[first + i]), payload) for i, payload in enumerate(stored)
                )
                hit = served
                self.stats.store_hit_tokens += len(stored) * c.block_size
            computed = self.kv.num_computed_tokens(seq.seq_id)
            rows.append(Row(seq, hit, computed))
            budget -= computed - hit
            self.stats.prefix_hit_tokens += hit
            if seq.index == 0 and not seq.request.forked:
                seq.request.cached_tokens = hit

    def _store_hits(self, seq_id: int, tokens: np.ndarray, hit: int, budget: int) -> list[np.ndarray]:
        """The store's payloads of the prompt's blocks after the ``hit`` (device and host) up
        to the last full block before its last token (that one is always computed)."""
        if self.tiers is None or self.tiers.worker is None or budget <= 0:
            return []  # no budget: the request waits, and a look-up now would only cost time
        bs = self.config.block_size
        last = (len(tokens) - 1) // bs
        if hit // bs >= last:
            return []
        hashes = self.kv.prefix_block_hashes(tokens)[hit // bs : last]
        return self.tiers.lookup(hashes, seq_id)

    def _next_admission(self) -> int:
        self._admissions += 1
        return self._admissions - 1

    # ---- after the forward pass -----------------------------------------------------------

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
        if seq.status is SeqStatus.RUNNING and self.kv.num_tokens(seq.seq_id) > len(seq.token_ids) - 1:
            self.kv.truncate(seq.seq_id, len(seq.token_ids) - 1)
        seq.draft_ids = []

    def fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """The samples 1..n-1 of ``parent``'s request share its blocks from now on."""
        for child in children:
            self.kv.fork(parent.seq_id, child.seq_id)
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
        if seq.seq_id in self._appended:
            # Its tokens appended this step are "computed" in the manager, but no pass will
            # write them now: drop them, so that the watermark covers written K/V only (a block
            # they filled leaves the prefix index) and the sequence decodes them again later.
            self.kv.truncate(seq.seq_id, len(seq.token_ids) - 1)
            self._appended.discard(seq.seq_id)
        seq.draft_ids = []
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
        self.waiting.appendleft(seq)
        self.stats.recompute_preemptions += 1
