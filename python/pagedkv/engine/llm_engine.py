"""LLMEngine: continuous batching of a llama model over one KvCacheManager and paged K/V caches.

Each ``step()``:

1. swaps back in the sequences preempted by swap (oldest first) while blocks allow;
2. appends every decoding sequence's last sampled token (``append_tokens_batch``, one crossing),
   preempting the most recently admitted sequence (recompute or swap) while blocks run short;
3. admits waiting requests first-come-first-served while blocks allow: ``add_sequence`` returns the
   prefix-cache hit, and only the uncached suffix is prefilled;
4. spends the per-step token budget: one row per decoding sequence, then prefill chunks in
   admission order (chunked prefill);
5. executes the manager's pending copy-on-write copies, then runs ONE forward pass over all rows;
6. samples for the rows that end a sequence's known tokens; sample 0 of an ``n > 1`` request is
   forked into n sequences first (the prompt blocks are shared; the partial last block is copied
   on the first append of each).

Prefix-cache hits only on computed blocks: the manager enters a sequence's full blocks in its
prefix index when the sequence is added, before their K/V exist, so a request admitted while
another one is still prefilling the same prefix could hit blocks not yet written (and the blocks
of a preempted or failed prefill stay indexed with stale contents). The engine therefore tracks,
per physical block, whether its K/V are complete (``_valid``): a hit is trusted only up to the
first incomplete block; an incomplete hit block that nobody else holds is simply recomputed in
place, and one that another live sequence is still filling defers the admission to a later step.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

import pagedkv
from pagedkv.engine.kv_store import PagedKvStore
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.request import (
    CompletionOutput,
    Request,
    RequestOutput,
    SeqStatus,
    Sequence,
    StreamEvent,
)
from pagedkv.engine.sampling import sample_token
from pagedkv.errors import InvalidArgumentError, OutOfBlocksError
from pagedkv.models import LoadedModel

__all__ = ["EngineConfig", "EngineStats", "LLMEngine"]


@dataclass(frozen=True)
class EngineConfig:
    num_blocks: int = 512
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_host_blocks: int = 0
    preemption: Literal["recompute", "swap"] = "recompute"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 256  # rows per forward pass (decode rows + prefill chunks)
    enable_chunked_prefill: bool = True
    # "paged": blocks on demand. "contiguous": also admit only while every running sequence can
    # reserve max_model_len slots (the contiguous-reservation baseline on the same KV memory).
    reservation: Literal["paged", "contiguous"] = "paged"
    max_model_len: int | None = None  # default: the model's context length
    # Free blocks an admission must leave for the running sequences' next appends (default: 1% of
    # the pool), so that admitting does not force an immediate preemption.
    admission_watermark_blocks: int | None = None


@dataclass
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0  # tokens whose K/V were computed as prefill
    decode_tokens: int = 0
    generated_tokens: int = 0
    prefix_hit_tokens: int = 0
    deferred_admissions: int = 0
    preemptions_recompute: int = 0
    preemptions_swap: int = 0
    cow_copies: int = 0
    batch_sizes: list[int] = field(default_factory=list)  # sequences per forward pass
    blocks_in_use: list[int] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        return {
            "steps": self.steps,
            "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens,
            "generated_tokens": self.generated_tokens,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "deferred_admissions": self.deferred_admissions,
            "preemptions_recompute": self.preemptions_recompute,
            "preemptions_swap": self.preemptions_swap,
            "cow_copies": self.cow_copies,
            "mean_batch": float(np.mean(self.batch_sizes)) if self.batch_sizes else 0.0,
            "mean_blocks_in_use": float(np.mean(self.blocks_in_use)) if self.blocks_in_use else 0.0,
            "max_blocks_in_use": max(self.blocks_in_use, default=0),
        }


class LLMEngine:
    def __init__(self, model: LoadedModel, config: EngineConfig | None = None) -> None:
        self.model = model
        self.config = c = config or EngineConfig()
        self.max_model_len = min(c.max_model_len or model.config.max_model_len, model.config.max_model_len)
        if c.preemption == "swap" and c.num_host_blocks <= 0:
            raise InvalidArgumentError("preemption='swap' needs num_host_blocks > 0")
        self.kv = pagedkv.KvCacheManager(
            num_blocks=c.num_blocks,
            block_size=c.block_size,
            enable_prefix_caching=c.enable_prefix_caching,
            num_host_blocks=c.num_host_blocks,
        )
        self.store = PagedKvStore(model.config, c.num_blocks, c.block_size, c.num_host_blocks)
        self._valid = np.zeros(c.num_blocks, dtype=bool)  # block's K/V complete for its tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.requests: dict[int, Request] = {}
        self.stats = EngineStats()
        self._next_seq_id = 0
        self._next_request_id = 0
        self._admissions = 0
        self._events: list[StreamEvent] = []

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, request_id: int | None = None
    ) -> int:
        """Queue a request; InvalidArgumentError (nothing queued) if it can never run here."""
        ids = [int(t) for t in prompt_ids]
        vocab = self.model.config.vocab_size
        if not ids or any(t < 0 or t >= vocab for t in ids):
            raise InvalidArgumentError(f"a prompt must be 1 or more token ids in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise InvalidArgumentError(
                f"the prompt has {len(ids)} tokens; the model's context holds {self.max_model_len} "
                "(prompt plus at least one generated token)"
            )
        bs = self.config.block_size
        total = min(len(ids) + params.max_tokens, self.max_model_len)
        shared = len(ids) // bs  # full prompt blocks the n samples share
        needed = shared + params.n * (-(-(total - shared * bs) // bs))
        if needed > self.config.num_blocks:
            raise InvalidArgumentError(
                f"n={params.n} samples of {total} tokens need {needed} blocks at most; the pool has "
                f"{self.config.num_blocks}"
            )
        if request_id is None:
            request_id = self._next_request_id
        if request_id in self.requests:
            raise InvalidArgumentError(f"request id {request_id} is already in use")
        self._next_request_id = max(self._next_request_id, request_id + 1)
        request = Request(request_id, ids, params, time.perf_counter())
        request.sequences.append(self._new_sequence(request, 0, list(ids)))
        self.requests[request_id] = request
        self.waiting.append(request.sequences[0])
        return request_id

    def _new_sequence(self, request: Request, index: int, token_ids: list[int]) -> Sequence:
        seed = request.params.seed
        rng = np.random.default_rng(None if seed is None else seed + index)
        seq = Sequence(self._next_seq_id, request, index, token_ids, rng)
        self._next_seq_id += 1
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def output(self, request_id: int) -> RequestOutput:
        r = self.requests[request_id]
        tpots = [
            (s.token_times_s[-1] - s.token_times_s[0]) / (len(s.token_times_s) - 1)
            for s in r.sequences
            if len(s.token_times_s) > 1
        ]
        return RequestOutput(
            request_id=r.request_id,
            prompt=None,
            prompt_token_ids=r.prompt_ids,
            outputs=[
                CompletionOutput(s.index, s.text, list(s.output_ids), s.finish_reason) for s in r.sequences
            ],
            ttft_s=None if r.first_token_s is None else r.first_token_s - r.arrival_s,
            tpot_s=float(np.mean(tpots)) if tpots else None,
            num_cached_tokens=r.cached_tokens,
        )

    # ---- one step -------------------------------------------------------------------------

    def step(self) -> list[StreamEvent]:
        """Schedule, run one forward pass, sample; returns the tokens produced by this step."""
        self._events = []
        self._swap_in()
        self._append_decode_tokens()
        self._admit()
        rows = self._plan_rows()
        if rows:
            self._run(rows)
        self.stats.steps += 1
        return self._events

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
            self._mark_valid(seq, 0, seq.num_computed)

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
                self._preempt(max(self.running, key=lambda s: s.admitted))
                continue
            for s in decoding:
                s.num_in_kv += 1
                if (s.num_in_kv - 1) % self.config.block_size == 0:  # a fresh block
                    self._valid[self.kv.block_table(s.seq_id)[-1]] = False
            return

    def _reserved_slots(self) -> int:
        return sum(self.max_model_len for _ in self.running) + sum(self.max_model_len for _ in self.swapped)

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
            table = self.kv.block_table(seq.seq_id)
            trusted = 0
            while trusted < hit // c.block_size and self._valid[table[trusted]]:
                trusted += 1
            stale = table[trusted : hit // c.block_size]
            if any(self.kv.refcount(int(b)) > 1 for b in stale):
                # Another live sequence is still computing these blocks: come back next step.
                self.kv.free(seq.seq_id)
                self.stats.deferred_admissions += 1
                return
            self._valid[table[trusted:]] = False  # fresh blocks and stale revived ones
            self.waiting.popleft()
            seq.num_in_kv = len(seq.token_ids)
            seq.num_computed = min(trusted * c.block_size, seq.num_in_kv - 1)  # the last row gives logits
            seq.status = SeqStatus.RUNNING
            seq.admitted = self._admissions
            self._admissions += 1
            self.running.append(seq)
            self.stats.prefix_hit_tokens += seq.num_computed
            if seq.index == 0 and not seq.request.forked:
                seq.request.cached_tokens = seq.num_computed

    def _plan_rows(self) -> list[tuple[Sequence, int, int]]:
        """(sequence, first position, end position) of this pass's rows, within the token budget."""
        budget = self.config.max_num_batched_tokens
        rows = []
        for s in sorted(self.running, key=lambda s: s.admitted):
            if s.output_ids and s.num_computed == s.num_in_kv - 1 == len(s.token_ids) - 1:
                rows.append((s, s.num_computed, s.num_in_kv))
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
            rows.append((s, s.num_computed, s.num_computed + chunk))
            budget -= chunk
        return rows

    def _run(self, rows: list[tuple[Sequence, int, int]]) -> None:
        ops = self.kv.take_copy_ops()
        self.stats.cow_copies += len(ops)
        self.store.copy(ops)
        for src, dst in ops.tolist():
            self._valid[dst] = self._valid[src]
        seq_ids = [s.seq_id for s, _, _ in rows]
        tables, _ = self.kv.batch_block_tables(seq_ids)
        ctx = np.array([end for _, _, end in rows], dtype=np.int32)
        q_lens = np.array([end - start for _, start, end in rows], dtype=np.int32)
        self.store.set_batch(tables, ctx, q_lens)
        tokens = np.concatenate([np.asarray(s.token_ids[a:b], dtype=np.int64) for s, a, b in rows])
        positions = np.concatenate([np.arange(a, b, dtype=np.int64) for _, a, b in rows])
        ends = np.cumsum(q_lens) - 1
        finishing = [i for i, (s, _, end) in enumerate(rows) if end == len(s.token_ids)]
        logits = self.model.model.forward(tokens, positions, self.store, ends[finishing])
        self.stats.batch_sizes.append(len(rows))
        self.stats.blocks_in_use.append(self.kv.num_blocks - self.kv.num_free_blocks)
        for s, a, b in rows:
            if s.output_ids and b - a == 1 and b == len(s.token_ids):
                self.stats.decode_tokens += 1
            else:
                self.stats.prefill_tokens += b - a
            s.num_computed = b
            self._mark_valid(s, a, b)
        now = time.perf_counter()
        for row, i in enumerate(finishing):
            seq = rows[i][0]
            for sample in self._fork(seq):
                self._sample(sample, logits[row], now)

    def _mark_valid(self, seq: Sequence, start: int, end: int) -> None:
        bs = self.config.block_size
        full = end // bs
        if full > start // bs:
            table = self.kv.block_table(seq.seq_id)
            self._valid[table[start // bs : full]] = True

    def _fork(self, seq: Sequence) -> list[Sequence]:
        request = seq.request
        if request.forked or seq.index != 0:
            return [seq]
        request.forked = True
        for i in range(1, request.params.n):
            child = self._new_sequence(request, i, list(seq.token_ids))
            self.kv.fork(seq.seq_id, child.seq_id)
            child.num_in_kv, child.num_computed = seq.num_in_kv, seq.num_computed
            child.status, child.admitted = SeqStatus.RUNNING, self._admissions
            self._admissions += 1
            request.sequences.append(child)
            self.running.append(child)
        return list(request.sequences)

    def _sample(self, seq: Sequence, logits: np.ndarray, now: float) -> None:
        params = seq.request.params
        token = sample_token(logits, params, seq.rng)
        tok = self.model.tokenizer
        seq.output_ids.append(token)
        seq.token_times_s.append(now)
        self.stats.generated_tokens += 1
        if seq.request.first_token_s is None:
            seq.request.first_token_s = now
        reason = None
        if not params.ignore_eos and token in tok.stop_token_ids:
            reason = "stop"
        text = tok.decode(seq.output_ids, skip_special_tokens=True)
        if text.endswith("\ufffd") and reason is None:
            text = seq.text  # an incomplete UTF-8 sequence: wait for the next token
        for stop in params.stop:
            at = text.find(stop)
            if at >= 0:
                text, reason = text[:at], "stop"
        delta = text[len(seq.text) :] if text.startswith(seq.text) else text
        seq.text = text
        if reason is None and (
            len(seq.output_ids) >= params.max_tokens or len(seq.token_ids) + 1 >= self.max_model_len
        ):
            reason = "length"
        if reason is None:
            seq.token_ids.append(token)
        else:
            seq.finish_reason = reason
            self._finish(seq, now)
        self._events.append(
            StreamEvent(seq.request.request_id, seq.index, token, delta, reason is not None, reason)
        )

    def _finish(self, seq: Sequence, now: float) -> None:
        seq.status = SeqStatus.FINISHED
        self.kv.free(seq.seq_id)
        self.running.remove(seq)
        if seq.request.finished:
            seq.request.finish_s = now

    def _preempt(self, seq: Sequence) -> None:
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
                self.stats.preemptions_swap += 1
                return
        self.kv.free(seq.seq_id)
        self.running.remove(seq)
        seq.status = SeqStatus.WAITING
        seq.num_in_kv = seq.num_computed = 0
        self.waiting.appendleft(seq)
        self.stats.preemptions_recompute += 1
