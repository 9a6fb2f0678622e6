"""LLMEngine: continuous batching of a llama model over one KvCacheManager and paged K/V caches.

The engine composes three parts (the layout of nano-vllm's engine): the ``Scheduler`` decides which
sequences hold blocks and which rows the next pass computes, the ``ModelRunner`` executes that pass
on the paged store, and the engine itself turns the sampling rows' logits into tokens, forks
``n > 1`` requests after their prefill (sample 0 is forked into n sequences; the prompt blocks are
shared, the partial last block is copied on each sample's first append), verifies speculative
drafts (``EngineConfig.speculative_ngram``) and finishes sequences.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

import pagedkv
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.kv_layout import kv_layout, layer_windows, new_manager
from pagedkv.engine.model_runner import ModelRunner
from pagedkv.engine.outputs import RequestOutput, StreamEvent, request_output
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.prompts import prompt_token_ids
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
        self.config = c = EngineConfig() if config is None else config
        if not isinstance(c, EngineConfig):
            raise InvalidArgumentError(f"config must be an EngineConfig, got {type(c).__name__}")
        self.max_model_len = min(c.max_model_len or model.config.max_model_len, model.config.max_model_len)
        self.layout = kv_layout(layer_windows(model.config), hybrid=c.hybrid_kv)
        reserved = self.layout.num_groups * self.max_model_len  # slots of one sequence, every group
        if c.reservation == "contiguous" and reserved > c.num_blocks * c.block_size:
            # No request could ever reserve its slots: the engine would admit nothing, forever.
            raise InvalidArgumentError(
                f"reservation='contiguous' reserves max_model_len = {self.max_model_len} slots per "
                f"sequence and KV group ({self.layout.num_groups}); the pool has {c.num_blocks} x "
                f"{c.block_size} = {c.num_blocks * c.block_size}"
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

            identity = store_identity(model, c.block_size)
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
            m = model.config
            block_shape = (self.layout.layers_per_group, 2, c.block_size, m.num_kv_heads, m.head_dim)
            lookup = StoreLookup(self.store_worker, identity, block_shape, c.block_size, c.offload_deadline_s)
        self.store_lookup = lookup
        self.scheduler = Scheduler(c, self.max_model_len, self.kv, self.layout, self.stats, lookup)
        self.requests: dict[int, Request] = {}
        self._next_seq_id = 0
        self._next_request_id = 0
        self._events: list[StreamEvent] = []
        self._idle_steps = 0

    def _make_manager(self) -> pagedkv.KvCacheManager:
        """The block manager: one block table per KV group of the layout."""
        c = self.config
        manager: pagedkv.KvCacheManager = new_manager(
            self.layout,
            num_blocks=c.num_blocks,
            block_size=c.block_size,
            enable_prefix_caching=c.enable_prefix_caching,
            num_host_blocks=c.num_host_blocks,
            num_host_cache_blocks=c.num_host_cache_blocks,
        )
        return manager

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
