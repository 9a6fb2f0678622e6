"""The scheduler: which sequences hold blocks, which run in the next forward pass, and which rows
of their tokens it computes.

Three queues, as in vLLM and nano-vllm: ``waiting`` (not in the KV manager: new, or preempted by
recompute), ``running`` (blocks on the device) and ``swapped`` (blocks in the swap tier). One
``schedule()``:

1. swaps back in the sequences preempted by swap (oldest first) while blocks allow;
2. allocates every decoding sequence's slots for its last sampled token and its speculative
   drafts (``allocate_slots``, then ``provide_token_ids``), in admission order; a refusal
   drops the drafts, then preempts the most recently admitted sequence (recompute or swap) and
   retries;
3. spends the per-step token budget: one row per decoding sequence (plus its drafts), then the
   next prefill chunk of each running sequence still prefilling, in admission order, each
   given its blocks as it is planned (``allocate_slots``; a refusal preempts as in 2);
4. admits waiting requests in the order of ``EngineConfig.scheduling`` (``waiting_order.py``:
   first come first served, or cache-aware with an aging bound) while blocks and budget allow:
   ``match_prefix`` gives the prefix-cache hit without side effects, and ``add_sequence(...,
   num_scheduled=chunk, reserve_prompt=False)`` takes blocks for the hit and the first chunk
   of the uncached suffix only (vLLM's per-chunk contract, docs/engine.md);
5. takes the manager's pending data moves and returns the plan, a ``ScheduledBatch``: the rows,
   their block tables, and the moves in the order the model runner runs them
   (``scheduled_batch.py``): swap-ins and swap-outs as they are decided, each swap-in after the
   host-cache offload ops recorded before it, then the remaining offload ops, the
   copy-on-write copies, the host-cache loads, the store hits, and after the pass the blocks
   to save to the store.

An int4 cache keeps each running sequence's open block in a residual slot (``ResidualSlots``):
the scheduler hands those out with the blocks (one on admission, plus one reserved per further
sample of the request; the parent's copied into a reserved one on fork; released on finish and
recompute preemption; moved to a host slot and back with a swap) and reopens a sealed block that
a rejected draft's truncation cut into. Those moves are ops of the plan too; the ones decided
between steps (forks and truncations happen while the engine samples) run first in the next.

The scheduler talks to the block manager and to the store's look-ups (``StoreLookup``: a
store hit decides how much of a prompt is computed, so it is planned here; its blocks travel in
the plan); it holds no K/V array and moves none: every data move is an op of the plan, run by
the model runner, the one place where engine data moves. Admission looks the prompt's next
blocks up in the store after the device and host-cache hits.

Which K/V exist is the manager's computed watermark (``num_computed_tokens``), never shadowed
here. Like vLLM's scheduler, the watermark moves when a chunk is *scheduled*: the pass that
computes it runs right after ``schedule()``, and attention writes each layer's K/V before reading
it, so a request admitted in the same step may hit those blocks. That is sound only if every
scheduled chunk is executed, hence: nothing is preempted after the step's admissions
(preemption happens in steps 2 and 3, and a sequence preempted after its slots were allocated
this step first truncates those tokens and loses its row, so the watermark drops back to what
earlier passes wrote), and a failed pass rolls its
sequences back (``rollback``) before their requests fail. The manager caps every hit below the
prompt's length, so the last prompt token is always computed and gives the first logits.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

import pagedkv
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.kv_layout import KvLayout
from pagedkv.engine.manager_options import max_pass_tokens
from pagedkv.engine.ngram_proposer import propose_ngram_drafts
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.residual_slots import ResidualSlots
from pagedkv.engine.scheduled_batch import (
    CopyBlocks,
    DataOp,
    Load,
    Offload,
    Row,
    SaveComputed,
    ScheduledBatch,
    StoreHits,
    SwapIn,
)
from pagedkv.engine.sequence import SeqStatus, Sequence
from pagedkv.engine.sequence_lifecycle import SequenceLifecycle
from pagedkv.engine.stats import EngineStats
from pagedkv.engine.store_lookup import PREFETCH_DEPTH, StoreLookup
from pagedkv.engine.waiting_order import WaitingOrder
from pagedkv.errors import InvalidArgumentError, OutOfBlocksError

__all__ = ["Scheduler"]


@dataclass(frozen=True)
class _Admission:
    """How the head of the queue is admitted: ``hit`` prompt tokens the device and host cache
    serve (``match_prefix``), ``stored`` store blocks after them ((hash, payload) each), and
    the ``chunk`` of the rest the pass computes."""

    hit: int
    stored: list[tuple[int, np.ndarray]]
    chunk: int


class Scheduler(SequenceLifecycle):
    """Plans each step on ``kv`` (the block manager): it holds no K/V, and moves none
    (``ScheduledBatch`` carries the moves to the model runner). ``layout``: the KV groups
    (metadata only); ``store``: the store's look-ups, when the engine has a store;
    ``residual``: an int4 cache's device and host residual slots. The engine's calls after a
    pass, forks, finishing, aborting and preemption are its base's (sequence_lifecycle.py)."""

    def __init__(
        self,
        config: EngineConfig,
        max_model_len: int,
        kv: pagedkv.KvCacheManager,
        layout: KvLayout,
        stats: EngineStats,
        store: StoreLookup | None = None,
        residual: tuple[ResidualSlots, ResidualSlots] | None = None,
    ) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.kv = kv
        self.num_groups = layout.num_groups
        self.group_windows = layout.group_windows
        self.store = store
        self.stats = stats
        self.waiting: deque[Sequence] = deque()
        self.order = WaitingOrder(config, kv)
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self._admissions = 0
        # Sequences whose admission failed for a reason of their own (not a lack of blocks): the
        # engine finishes their requests with an error status.
        self.failed: list[tuple[Sequence, Exception]] = []
        # The step being planned: its data ops so far, in order, and its store hits.
        self._ops: list[DataOp] = []
        self._store_hits: list[tuple[int, int, np.ndarray]] = []
        self._appended: set[int] = set()  # seq ids whose append this step no pass has written yet
        self.slots: ResidualSlots | None = residual[0] if residual is not None else None
        self.host_slots: ResidualSlots | None = residual[1] if residual is not None else None
        # Residual moves decided between steps (forks, reopened blocks): the next plan's first ops.
        self._pending: list[DataOp] = []
        self._swap_reserve: dict[int, int] = {}  # a swapped-out sequence's reserved slots

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
        if self.slots is not None and params.n > self.slots.num_slots:
            raise InvalidArgumentError(
                f"n={params.n} samples need as many int4 residual slots at once; the engine has "
                f"max_num_seqs = {self.slots.num_slots}"
            )
        needed = self.blocks_to_fit(num_prompt_tokens, params)
        if needed > self.config.pool_blocks:
            raise InvalidArgumentError(
                f"n={params.n} samples of {total} tokens need {needed} blocks at most"
                + (f" over {self.num_groups} KV groups" if self.num_groups > 1 else "")
                + f"; the pool has {self.config.pool_blocks}"
            )

    def blocks_to_fit(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The blocks a request alone needs at most, over every KV group: in a full-attention
        group the shared full prompt blocks plus each sample's own blocks up to its full
        length; in a sliding-window group at most what its window and a pass's tokens span per
        sample (``window_blocks``), since blocks are allocated per scheduled chunk and the
        window releases what it has passed. A request within it never meets the manager's
        "can never fit" refusal."""
        bs = self.config.block_size
        total = min(num_prompt_tokens + params.max_tokens, self.max_model_len)
        shared = num_prompt_tokens // bs  # full prompt blocks the n samples share
        full = shared + params.n * (-(-(total - shared * bs) // bs))
        per_sample = -(-total // bs)
        return sum(
            full if w is None else params.n * min(per_sample, self.window_blocks(w, total))
            for w in self.group_windows
        )

    def window_blocks(self, window: int, num_tokens: int) -> int:
        """The most blocks one sequence of up to ``num_tokens`` tokens holds in a group of this
        window: the ``window - 1`` tokens before a pass's first, the pass's own
        (``max_pass_tokens``; without chunked prefill up to all of them), and one block more
        where the window does not start at a block boundary."""
        chunked = self.config.enable_chunked_prefill
        in_pass = max_pass_tokens(self.config, self.max_model_len) if chunked else num_tokens
        return -(-(window - 1 + in_pass) // self.config.block_size) + 1

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.order.add(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # ---- one step -------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        self._ops, self._store_hits, self._pending = self._pending, [], []
        self._appended = set()
        self._swap_in()
        self._append_decode_tokens()
        budget = self.config.max_num_batched_tokens
        rows = self._plan_running(budget)
        budget -= sum(r.end - r.start for r in rows)
        self._admit(rows, budget)
        if self.store is not None:
            # The next admissions' store blocks load while this step's pass runs.
            waiting = [
                (s.seq_id, np.array(s.token_ids, dtype=np.int64)) for s in list(self.waiting)[:PREFETCH_DEPTH]
            ]
            self.store.prefetch(self.kv, waiting)
        self._take_offloads()
        copies = self.kv.take_copy_ops() if rows else np.zeros((0, 2), np.int32)
        self.stats.cow_copies += len(copies)
        if len(copies):
            self._ops.append(CopyBlocks(copies))
        if self.config.num_host_cache_blocks:
            loads = self.kv.take_load_ops()
            if len(loads):
                self._ops.append(Load(loads))
        if self._store_hits:
            self._ops.append(StoreHits(tuple(self._store_hits)))
        ops, self._ops, self._store_hits = self._ops, [], []
        return ScheduledBatch(
            rows, self._block_tables(rows), ops, self._plan_saves(rows), self._row_slots(rows)
        )

    def _row_slots(self, rows: list[Row]) -> np.ndarray | None:
        """Each row's sequence's residual slot (an int4 cache), row order."""
        if self.slots is None:
            return None
        return np.array([self.slots.slot(r.seq.seq_id) for r in rows], dtype=np.int32)

    def _slots_needed(self, seq: Sequence) -> int:
        """Residual slots an admission takes: one, and one per sample the request still forks."""
        request = seq.request
        return request.params.n if seq.index == 0 and not request.forked else 1

    def _block_tables(self, rows: list[Row]) -> list[np.ndarray]:
        """The rows' block tables, one per KV group."""
        if not rows:
            return []
        seq_ids = [r.seq.seq_id for r in rows]
        if self.num_groups > 1:
            return [self.kv.batch_block_tables(seq_ids, group=g)[0] for g in range(self.num_groups)]
        return [self.kv.batch_block_tables(seq_ids)[0]]

    def _take_offloads(self) -> None:
        """The offload ops recorded so far, as one op: planned before anything writes the
        device blocks they read (a swap-in's copies, this step's copies, loads and pass)."""
        if not self.config.num_host_cache_blocks:
            return
        recorded = self.kv.take_offload_ops()
        if not len(recorded):
            return
        # Ops into the same host block: only the last one's content stays (the host cache
        # dropped the earlier entries), and the copy kernels refuse a destination named twice.
        last = {int(h): int(d) for d, h in recorded}
        ops = np.array([[d, h] for h, d in last.items()], np.int32)
        hashes = tuple(self.kv.offload_block_hash(h) for h in last) if self.store is not None else ()
        self._ops.append(Offload(ops, hashes))

    def _plan_saves(self, rows: list[Row]) -> SaveComputed | None:
        """Save-on-compute (``offload_policy="compute"``): every block a row fills up (all its
        tokens computed by the pass, so the manager indexes it), with its chained hash."""
        if self.store is None or self.config.offload_policy != "compute":
            return None
        bs = self.config.block_size
        blocks: list[int] = []
        hashes: list[int] = []
        for row in rows:
            first, full = row.start // bs, row.end // bs
            if full <= first:
                continue  # no block filled up in this row
            seq = row.seq
            # Draft tokens included: a block of drafts holds their K/V (a rejected draft's block
            # leaves the index when truncated, its stored copy is still right for its tokens).
            tokens = np.asarray((seq.token_ids + seq.draft_ids)[: full * bs], dtype=np.int64)
            table = self.kv.block_table(seq.seq_id)
            for i, block_hash in enumerate(self.kv.prefix_block_hashes(tokens)[first:full], start=first):
                blocks.append(int(table[i]))
                hashes.append(block_hash)
        return SaveComputed(tuple(blocks), tuple(hashes)) if blocks else None

    def _swap_in(self) -> None:
        while self.swapped:
            seq = min(self.swapped, key=lambda s: s.admitted)
            need = 1 + self._swap_reserve.get(seq.seq_id, 0)
            if self.slots is not None and not self.slots.can_take(need):
                return
            try:
                mapping = self.kv.swap_in([seq.seq_id])
            except OutOfBlocksError:
                return
            self._take_offloads()  # they read device blocks the swap-in writes
            residual = np.zeros((0, 2), np.int32)
            if self.slots is not None and self.host_slots is not None:
                device = self.slots.take(seq.seq_id, reserve=self._swap_reserve.pop(seq.seq_id, 0))
                host = self.host_slots.slot(seq.seq_id)
                self.host_slots.release(seq.seq_id)
                residual = np.array([[host, device]], np.int32)
            if len(mapping) or len(residual):
                self._ops.append(SwapIn(mapping, residual))
            self.swapped.remove(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)

    def _needs_append(self, seq: Sequence) -> bool:
        """A decoding sequence whose last sampled token is not in the manager yet."""
        return bool(seq.output_ids) and self.kv.num_tokens(seq.seq_id) == len(seq.token_ids) - 1

    def _append_decode_tokens(self) -> None:
        """Slots for every decoding sequence's last sampled token and its drafts, per sequence
        in admission order (``allocate_slots``, then ``provide_token_ids`` with their ids). A
        refusal is the preemption signal: a sequence first drops its drafts (drafts never cost a
        preemption), then the most recently admitted sequence is preempted and the allocation
        retried, as vLLM's scheduler does."""
        decoding = sorted((s for s in self.running if self._needs_append(s)), key=lambda s: s.admitted)
        for s in decoding:
            s.draft_ids = []
        if self.config.speculative_ngram > 0:
            self._propose(decoding)
        for s in decoding:
            while s.status is SeqStatus.RUNNING:
                if self.kv.allocate_slots(s.seq_id, 1 + len(s.draft_ids)):
                    tokens = np.array([s.token_ids[-1], *s.draft_ids], dtype=np.int64)
                    self.kv.provide_token_ids(s.seq_id, tokens)
                    self._appended.add(s.seq_id)
                    break
                if s.draft_ids:
                    s.draft_ids = []
                    continue
                self.preempt(max(self.running, key=lambda r: r.admitted))

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
        """Decode rows first (always: their slots are allocated), then the next prefill chunk of
        each running sequence still prefilling, in admission order; each chunk gets its blocks
        as it is planned (``allocate_slots``: the watermark moves with them). A refusal preempts
        the most recently admitted sequence (dropping its decode row: its appended token is
        truncated) and retries; when that is the sequence itself, it waits."""
        rows = []
        by_admission = sorted(self.running, key=lambda s: s.admitted)
        for s in by_admission:
            if s.seq_id in self._appended:
                start = len(s.token_ids) - 1
                rows.append(Row(s, start, start + 1 + len(s.draft_ids), decode=True))
                budget -= 1 + len(s.draft_ids)
        for s in by_admission:
            if s.status is not SeqStatus.RUNNING or s.seq_id in self._appended:
                continue
            computed = self.kv.num_computed_tokens(s.seq_id)
            remaining = self.kv.num_tokens(s.seq_id) - computed
            if remaining <= 0:
                continue
            chunk = self._chunk(remaining, budget, bool(rows))
            if chunk == 0:
                break
            while s.status is SeqStatus.RUNNING and not self.kv.allocate_slots(s.seq_id, chunk):
                victim = max(self.running, key=lambda r: r.admitted)
                self.preempt(victim)
                for row in [r for r in rows if r.seq is victim]:
                    rows.remove(row)
                    budget += row.end - row.start
            if s.status is not SeqStatus.RUNNING:
                break  # preempted itself: every later-admitted sequence is gone already
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

    # ---- admission ------------------------------------------------------------------------

    def _admit(self, rows: list[Row], budget: int) -> None:
        """Admit waiting requests in the configured order (``WaitingOrder``; the request due
        next blocks the rest when it does not fit, as FCFS's head does) while sequences, blocks
        and the token budget allow, each in named steps: room for it (``_has_room``), what serves its
        prompt and what the pass computes (``_plan_admission``), the manager's all-or-nothing
        ``add_sequence``, then the running queue (``_start_running``), its store hits
        (``_place_store_hits``) and its first row (``_first_row``)."""
        self.order.sync()
        if self.swapped:
            return  # sequences waiting to swap back in go first
        try:
            self._admit_in_order(rows, budget)
        finally:
            self.order.record(self.stats)

    def _admit_in_order(self, rows: list[Row], budget: int) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.order.next(self.waiting)
            if not self._has_room(seq):
                return
            slots = self._slots_needed(seq)
            if self.slots is not None and not self.slots.can_take(slots):
                return
            tokens = np.array(seq.token_ids, dtype=np.int64)
            try:
                admission = self._plan_admission(seq, tokens, budget, bool(rows))
                if admission is None:
                    return
                served = admission.hit + len(admission.stored) * self.config.block_size
                # Per chunk (vLLM's admission): the whole prompt must fit after its hits (each
                # window group at its cap, plus the watermark while others run), and only the
                # hit and the scheduled tokens take blocks now.
                hit = self.kv.add_sequence(
                    seq.seq_id,
                    tokens,
                    num_scheduled=served - admission.hit + admission.chunk,
                    reserve_prompt=False,
                    apply_watermark=bool(self.running),
                    prompt_hashes=seq.prompt_hashes,
                )
            except OutOfBlocksError:
                return
            except pagedkv.PagedKvError as error:
                self.waiting.remove(seq)
                self.order.removed(seq)
                self.failed.append((seq, error))
                continue
            self._start_running(seq)
            if self.slots is not None:
                self.slots.take(seq.seq_id, reserve=slots - 1)
            self.order.admitted(seq)
            hit = self._place_store_hits(seq, hit, admission.stored)
            row = self._first_row(seq, hit)
            rows.append(row)
            budget -= row.end - row.start

    def _reserved_slots(self) -> int:
        """Slots the contiguous reservation holds: max_model_len per sequence in every KV group."""
        return self.num_groups * self.max_model_len * (len(self.running) + len(self.swapped))

    def _has_room(self, seq: Sequence) -> bool:
        """Under ``reservation="contiguous"``, the pool can reserve ``seq``'s max_model_len slots
        in every group. Blocks are the manager's check (``add_sequence`` with
        ``reserve_prompt=False``: the whole prompt must fit after its hits, each window group at
        its cap, plus the admission watermark while some sequence runs; all or nothing)."""
        c = self.config
        return not (
            c.reservation == "contiguous"
            and self._reserved_slots() + self.num_groups * self.max_model_len > c.pool_blocks * c.block_size
        )

    def _plan_admission(
        self, seq: Sequence, tokens: np.ndarray, budget: int, have_rows: bool
    ) -> _Admission | None:
        """The prefix-cache hit (``match_prefix``: device and host cache, no side effect), the
        store's blocks after it, and the first chunk of the rest; None when the budget has no
        room for a chunk (the request waits)."""
        hit = self.kv.match_prefix(tokens) if self.config.enable_prefix_caching else 0
        stored = self._lookup_store(seq.seq_id, tokens, hit, budget)
        served = hit + len(stored) * self.config.block_size
        chunk = self._chunk(len(tokens) - served, budget, have_rows)
        return _Admission(hit, stored, chunk) if chunk else None

    def _lookup_store(
        self, seq_id: int, tokens: np.ndarray, hit: int, budget: int
    ) -> list[tuple[int, np.ndarray]]:
        """The store's (hash, payload) of the prompt's blocks after the ``hit`` (device and
        host cache) up to the last full block before its last token (that one is always
        computed)."""
        if self.store is None or budget <= 0:
            return []  # no budget: the request waits, and a look-up now would only cost time
        bs = self.config.block_size
        last = (len(tokens) - 1) // bs
        if hit // bs >= last:
            return []
        hashes = self.kv.prefix_block_hashes(tokens)[hit // bs : last]
        return self.store.lookup(hashes, seq_id)

    def _start_running(self, seq: Sequence) -> None:
        if self.waiting[0] is seq:
            self.waiting.popleft()
        else:
            self.waiting.remove(seq)
        seq.status = SeqStatus.RUNNING
        seq.admitted = self._next_admission()
        self.running.append(seq)

    def _place_store_hits(self, seq: Sequence, hit: int, stored: list[tuple[int, np.ndarray]]) -> int:
        """Plan the store hits into the fresh blocks after the ``hit``; the tokens served."""
        if not stored:
            return hit
        bs = self.config.block_size
        table = self.kv.block_table(seq.seq_id)
        first = hit // bs
        self._store_hits.extend(
            (int(table[first + i]), block_hash, payload) for i, (block_hash, payload) in enumerate(stored)
        )
        self.stats.store_hit_tokens += len(stored) * bs
        return hit + len(stored) * bs

    def _first_row(self, seq: Sequence, served: int) -> Row:
        """The admitted sequence's first chunk, after the ``served`` prompt tokens."""
        computed = self.kv.num_computed_tokens(seq.seq_id)
        self.stats.prefix_hit_tokens += served
        if seq.index == 0 and not seq.request.forked:
            seq.request.cached_tokens = served
        return Row(seq, served, computed)
