"""LLMEngine: continuous batching of a llama model over one KvCacheManager and paged K/V caches.

The engine composes three parts (the layout of nano-vllm's engine): the ``Scheduler`` decides which
sequences hold blocks and which rows the next pass computes, the ``ModelRunner`` executes that pass
on the paged store, and the engine itself turns the sampling rows' logits into tokens, forks
``n > 1`` requests after their prefill (sample 0 is forked into n sequences; the prompt blocks are
shared, the partial last block is copied on each sample's first append), verifies speculative
drafts (``EngineConfig.speculative_ngram``) and finishes sequences.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import numpy as np

import pagedkv
from pagedkv.engine.config import MAX_NUM_BLOCKS, MAX_NUM_SLOTS, EngineConfig
from pagedkv.engine.kv_budget import (
    blocks_for_budget,
    default_kv_cache_bytes,
    pool_block_bytes,
    residual_bytes_per_sequence,
    residual_slot_counts,
    store_key_dtype,
)
from pagedkv.engine.kv_layout import kv_layout, layer_windows, new_manager
from pagedkv.engine.manager_options import manager_options, max_pass_tokens
from pagedkv.engine.model_runner import ModelRunner
from pagedkv.engine.outputs import RequestOutput, StreamEvent, request_output
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.prompts import prompt_token_ids
from pagedkv.engine.residual_slots import ResidualSlots
from pagedkv.engine.sampling import sample_token
from pagedkv.engine.scheduled_batch import Row
from pagedkv.engine.scheduler import Scheduler
from pagedkv.engine.sequence import Request, SeqStatus, Sequence
from pagedkv.engine.stats import EngineStats
from pagedkv.engine.stop_checker import record_token
from pagedkv.engine.store_flush import flush_at_exit
from pagedkv.engine.store_identity import store_identity
from pagedkv.engine.store_lookup import StoreLookup
from pagedkv.errors import InvalidArgumentError, InvariantViolation
from pagedkv.models import LoadedModel

if TYPE_CHECKING:
    from pagedkv.offload import OffloadWorker

__all__ = ["EngineConfig", "EngineStats", "LLMEngine"]


class LLMEngine:
    def __init__(self, model: LoadedModel, config: EngineConfig | None = None) -> None:
        self.model = model
        c = EngineConfig() if config is None else config
        if not isinstance(c, EngineConfig):
            raise InvalidArgumentError(f"config must be an EngineConfig, got {type(c).__name__}")
        self.max_model_len = min(c.max_model_len or model.config.max_model_len, model.config.max_model_len)
        self.layout = kv_layout(layer_windows(model.config), hybrid=c.hybrid_kv)
        # The pool in bytes, as blocks (the config the engine keeps has num_blocks set).
        self.kv_cache_bytes, c = self._size_pool(c)
        self.config = c
        reserved = self.layout.num_groups * self.max_model_len  # slots of one sequence, every group
        if c.reservation == "contiguous" and reserved > c.pool_blocks * c.block_size:
            # No request could ever reserve its slots: the engine would admit nothing, forever.
            raise InvalidArgumentError(
                f"reservation='contiguous' reserves max_model_len = {self.max_model_len} slots per "
                f"sequence and KV group ({self.layout.num_groups}); the pool has {c.pool_blocks} x "
                f"{c.block_size} = {c.pool_blocks * c.block_size}"
            )
        if c.num_host_cache_blocks and self.layout.is_hybrid:
            # The host cache and the store key a block by its tokens alone; the groups of a hybrid layout
            # hold different layers for the same tokens (docs/offload.md, Limits).
            raise InvalidArgumentError(
                "offload needs one KV group: this model has sliding-window layers; pass "
                "hybrid_kv=False to run it with offload"
            )
        self.store_worker: OffloadWorker | None = None
        identity = b""
        if c.offload is not None:
            from pagedkv.offload import OffloadWorker  # only with a store: needs the offload extra

            identity = store_identity(model, c.block_size, c.cache_dtype)
            self.store_worker = OffloadWorker(c.offload, name="engine-offload")  # type: ignore[arg-type]
            flush_at_exit(self.store_worker)  # its queued puts, if the caller never closes
        try:
            # First: it refuses a K/V store larger than memory.
            self.runner = ModelRunner(model, c, self.layout, self.store_worker, identity)
        except BaseException:
            if self.store_worker is not None:
                self.store_worker.close(0.0, drain=False)
            raise
        self.kv = self._make_manager()
        self.store = self.runner.store
        self.stats = EngineStats()
        lookup = None
        if self.store_worker is not None:
            payload_dtype, payload_shape = self.store.payload_spec
            lookup = StoreLookup(
                self.store_worker,
                identity,
                payload_shape,
                c.block_size,
                c.offload_deadline_s,
                block_dtype=payload_dtype,
                kv_cache_dtype=store_key_dtype(c.cache_dtype),
            )
        self.store_lookup = lookup
        slots, host_slots = residual_slot_counts(c.cache_dtype, c.max_num_seqs, c.num_host_blocks)
        residual = (ResidualSlots(slots), ResidualSlots(host_slots)) if slots else None
        self.scheduler = Scheduler(c, self.max_model_len, self.kv, self.layout, self.stats, lookup, residual)
        self.requests: dict[int, Request] = {}
        self._next_seq_id = 0
        self._next_request_id = 0
        self._events: list[StreamEvent] = []
        self._idle_steps = 0

    def _size_pool(self, c: EngineConfig) -> tuple[int, EngineConfig]:
        """(the pool's K/V bytes, ``c`` with ``num_blocks`` set): ``num_blocks`` as given, else
        the blocks ``kv_cache_bytes`` holds (default: ``default_kv_cache_bytes``), counted by
        engine/kv_budget.py (codes, scales, an int4 cache's residual slots)."""
        m = self.model.config
        dtype = c.cache_dtype
        shape = (self.layout, c.block_size, m.num_kv_heads, m.head_dim, dtype)
        per_block = pool_block_bytes(*shape)
        residual = residual_bytes_per_sequence(*shape) * residual_slot_counts(dtype, c.max_num_seqs, 0)[0]
        if c.num_blocks is not None:
            return c.num_blocks * per_block + residual, c
        budget = c.kv_cache_bytes
        if budget is None:
            budget = default_kv_cache_bytes(
                *shape,
                max_model_len=self.max_model_len,
                max_pass_tokens=max_pass_tokens(c, self.max_model_len),
                max_num_seqs=c.max_num_seqs if residual else 0,
            )
        blocks = blocks_for_budget(budget, *shape, max_num_seqs=c.max_num_seqs if residual else 0)
        blocks = min(blocks, MAX_NUM_BLOCKS, MAX_NUM_SLOTS // c.block_size)
        if blocks < 1:
            raise InvalidArgumentError(
                f"EngineConfig.kv_cache_bytes = {budget} holds no block of {per_block} bytes"
                + (f" after the residual slots ({residual} bytes)" if residual else "")
            )
        return budget, dataclasses.replace(c, num_blocks=blocks, kv_cache_bytes=None)

    def _make_manager(self) -> pagedkv.KvCacheManager:
        """The block manager: one block table per KV group of the layout, allocated per
        scheduled chunk (engine/manager_options.py)."""
        manager: pagedkv.KvCacheManager = new_manager(
            self.layout, **manager_options(self.config, self.max_model_len), **self._event_options()
        )
        return manager

    def _event_options(self) -> dict[str, int | bool]:
        """A cache-aware admission order follows the manager's KV events (engine/waiting_order.py),
        drained every step: the queue holds one step's, at most a store and a removal per block
        and KV group per admission (a dropped event would leave the order's index stale)."""
        c = self.config
        if c.scheduling == "fcfs":
            return {}
        per_step = 2 * c.pool_blocks * self.layout.num_groups * (c.max_num_seqs + 1)
        return {"enable_kv_events": True, "max_events": max(65_536, per_step)}

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, request_id: int | None = None
    ) -> int:
        """Queue a request; InvalidArgumentError (nothing queued) if it can never run here."""
        ids = prompt_token_ids(prompt_ids, self.model.config.vocab_size)
        if not isinstance(params, SamplingParams):
            raise InvalidArgumentError(f"params must be SamplingParams, got {type(params).__name__}")
        if request_id is not None and (
            isinstance(request_id, bool) or not isinstance(request_id, int) or not 0 <= request_id < 2**63
        ):
            raise InvalidArgumentError(f"request_id must be an integer in [0, 2**63), got {request_id!r}")
        self.scheduler.check_fits(len(ids), params)
        if request_id is None:
            request_id = self._next_request_id
        if request_id in self.requests:
            raise InvalidArgumentError(f"request id {request_id} is already in use")
        self._next_request_id = max(self._next_request_id, request_id + 1)
        request = Request(request_id, ids, params, time.perf_counter())
        request.sequences.append(self._new_sequence(request, 0, list(ids)))
        self.requests[request_id] = request
        self.scheduler.add(request.sequences[0])
        return request_id

    def _new_sequence(self, request: Request, index: int, token_ids: list[int]) -> Sequence:
        seed = request.params.seed
        rng = np.random.default_rng(None if seed is None else seed + index)
        seq = Sequence(self._next_seq_id, request, index, token_ids, rng)
        self._next_seq_id += 1
        return seq

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def close(self, timeout_s: float = 5.0) -> bool:
        """Write the store's queued blocks (at most ``timeout_s``) and stop its worker; ``True``
        when nothing was left behind. A no-op without a store."""
        if self.store_worker is None:
            return True
        if self.store_lookup is not None:
            self.store_lookup.close()
        dropped = self.store_worker.dropped_puts
        stopped = self.store_worker.close(timeout_s)
        self._count_store()
        return stopped and self.store_worker.dropped_puts == dropped

    def _count_store(self) -> None:
        """The store's counters into ``stats`` (the worker counts on its own thread)."""
        worker, lookup = self.store_worker, self.store_lookup
        if worker is None or lookup is None:
            return
        self.stats.store_deadline_misses = lookup.deadline_misses
        self.stats.store_puts_written = worker.completed_puts
        self.stats.store_puts_dropped = worker.dropped_puts
        self.stats.store_puts_failed = worker.failed_puts

    def output(self, request_id: int) -> RequestOutput:
        return request_output(self.requests[request_id])

    # ---- one step -------------------------------------------------------------------------

    def step(self) -> list[StreamEvent]:
        """Schedule, run one forward pass, sample; returns the tokens produced by this step."""
        self._events = []
        batch = self.scheduler.schedule()
        now = time.perf_counter()
        while self.scheduler.failed:
            seq, error = self.scheduler.failed.pop()
            self._fail(seq.request, error, now)
        if not batch.rows:
            # Only data moves (swap-ins and swap-outs, offloads): a failure there is the
            # engine's, not a request's.
            self.runner.execute(batch)
        else:
            try:
                samples = self.runner.execute(batch)
            except Exception as error:  # noqa: BLE001 - the batch's failure, not the engine's
                # The watermark covers K/V this pass may not have written: release them before
                # the requests fail, so that no later request hits them.
                self.scheduler.rollback(batch.rows)
                for request in {id(r.seq.request): r.seq.request for r in batch.rows}.values():
                    self._fail(request, error, now)
                samples = []
            self.stats.batch_sizes.append(len(batch.rows))
            self.stats.blocks_in_use.append(self.kv.num_blocks - self.kv.num_free_blocks)
            self.scheduler.computed_rows(batch.rows)
            now = time.perf_counter()
            for row, logits in samples:
                if row.seq.request.error is not None:
                    continue  # a sibling sample failed earlier in this step
                try:
                    for seq in self._fork(row.seq):
                        self._verify(seq, row, logits, now)
                except Exception as error:  # noqa: BLE001 - one request's failure, not the batch's
                    self._fail(row.seq.request, error, now)
            self._idle_steps = 0
        if not batch.rows and self.has_unfinished():
            # A step without a row changes nothing the next step depends on once nothing runs
            # (the first may still swap out the last running sequence): a second one in a row
            # would repeat forever. Validated configurations and requests never get here.
            self._idle_steps += 1
            if self._idle_steps > 2:
                raise InvariantViolation(
                    f"the engine made no progress for {self._idle_steps} steps with "
                    f"{len(self.scheduler.waiting)} waiting and {len(self.scheduler.swapped)} swapped "
                    "sequences: a pagedkv bug, please report it"
                )
        self.stats.steps += 1
        self._count_store()
        return self._events

    def _fail(self, request: Request, error: Exception, now: float) -> None:
        """Finish every unfinished sample of ``request`` with finish_reason "error" and free its
        blocks; the other requests of the batch go on."""
        request.error = f"{type(error).__name__}: {error}"
        request.forked = True  # no more samples will be made
        request.finish_s = now
        self.stats.failed_requests += 1
        for seq in request.sequences:
            if seq.status is SeqStatus.FINISHED:
                continue
            self.scheduler.abort(seq)
            seq.finish_reason = "error"
            self._events.append(
                StreamEvent(request.request_id, seq.index, -1, "", True, "error", request.error)
            )

    def _fork(self, seq: Sequence) -> list[Sequence]:
        request = seq.request
        if request.forked or seq.index != 0:
            return [seq]
        request.forked = True
        children = [self._new_sequence(request, i, list(seq.token_ids)) for i in range(1, request.params.n)]
        request.sequences.extend(children)  # first: a failing fork then aborts every one of them
        self.scheduler.fork(seq, children)
        return list(request.sequences)

    def _verify(self, seq: Sequence, row: Row, logits: np.ndarray, now: float) -> None:
        """Sample from the row's logits: one token, or for a speculative decode row the drafts
        the model agrees with (the token it chooses at each position equals the next draft) and
        then the token it chooses after the last accepted one; the rejected drafts are
        truncated. Only greedy sequences get drafts, so that this equals decoding one token per
        pass token for token."""
        drafts = seq.draft_ids
        accepted = generated = 0
        for i in range(len(logits)):
            token, finished = self._sample(seq, logits[i], now)
            generated += 1
            if finished or i == len(drafts) or token != drafts[i]:
                break
            accepted += 1
        if row.decode:
            self.stats.decode_passes += 1
            self.stats.decode_generated += generated
            self.stats.draft_tokens += len(drafts)
            self.stats.accepted_tokens += accepted
        self.scheduler.truncate_rejected(seq)

    def _sample(self, seq: Sequence, logits: np.ndarray, now: float) -> tuple[int, bool]:
        """(the token, whether it finished the sequence)."""
        token = sample_token(logits, seq.request.params, seq.rng)
        delta, reason = record_token(seq, token, self.model.tokenizer, self.max_model_len)
        seq.token_times_s.append(now)
        self.stats.generated_tokens += 1
        if seq.request.first_token_s is None:
            seq.request.first_token_s = now
        if reason is not None:
            seq.finish_reason = reason
            self.scheduler.finish(seq)
            if seq.request.finished:
                seq.request.finish_s = now
        self._events.append(
            StreamEvent(seq.request.request_id, seq.index, token, delta, reason is not None, reason)
        )
        return token, reason is not None
