"""``DecodeEngine``: generates from prompts whose K/V a prefill instance computed
(docs/transfer.md, The engine).

A request arrives with the prefill side's ``kv_transfer_params``. It waits outside the
scheduler until the pool has room for its prompt; then the manager admits it without
scheduling anything (``add_sequence(..., num_scheduled=0)``: its own prefix-cache hit shared),
the blocks the hit does not cover are read (``TransferSink.start``), and once the read is
checked the tokens whose K/V arrived intact count as computed (``advance_computed``) and the
sequence joins the scheduler's running queue: the rest of its prompt, at least the last token
(for the first logits) and every block that failed, is computed as an ordinary prefill chunk.
A read that failed entirely (a dead peer, a lease run out, a layout mismatch) is a recompute of
the prompt; the error is kept, typed, in ``transfer_errors``. No token is ever sampled from a
block whose checksum did not match.

One manager rule: a sliding-window group's positions the prefill side did not send (it sends
the window when it no longer holds the history) would enter the prefix index as computed when
the watermark passes them; then the engine recomputes instead of advancing over them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedkv.engine.config import EngineConfig, peer_address
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.prompts import prompt_token_ids
from pagedkv.engine.sequence import SeqStatus, Sequence
from pagedkv.errors import InvalidArgumentError, OutOfBlocksError, PagedKvError
from pagedkv.models import LoadedModel
from pagedkv.transfer import (
    KvRegions,
    KvTransferParams,
    TransferResult,
    TransferSink,
    destination_block_ids,
)

__all__ = ["DecodeEngine", "TransferRecord"]


@dataclass
class TransferRecord:
    """What one request's transfer did: blocks read intact, skipped (held already), failed, the
    prompt tokens the decode side did not compute, and the error (a ``TransferError``) if any."""

    blocks_read: int = 0
    blocks_skipped: int = 0
    blocks_failed: int = 0
    tokens_received: int = 0
    cached_tokens: int = 0
    error: str | None = None


@dataclass
class _Awaiting:
    seq: Sequence
    params: KvTransferParams
    started: bool = False
    cached: int = 0
    renewed_s: float = 0.0


class DecodeEngine(LLMEngine):
    """An ``LLMEngine`` whose requests bring their prompt's K/V from a prefill instance:
    ``add_request(..., kv_transfer_params=...)``. ``transfers[request_id]``: a
    ``TransferRecord`` per request once its read is done; ``transfer_errors``: the typed errors."""

    def __init__(self, model: LoadedModel, config: EngineConfig, *, timeout_s: float = 30.0) -> None:
        if config.kv_role != "decode":
            raise InvalidArgumentError(f"DecodeEngine needs kv_role='decode', got {config.kv_role!r}")
        super().__init__(model, config)
        c = self.config
        self.peer = peer_address(c.kv_peer) if c.kv_peer else None
        regions = KvRegions.from_caches(self.store.k_caches, self.store.v_caches, block_size=c.block_size)
        self.sink = TransferSink(regions, engine_id=f"decode-{id(self):x}", timeout_s=timeout_s)
        self._awaiting: dict[int, _Awaiting] = {}  # seq id -> its request, before it runs
        self.transfers: dict[int, TransferRecord] = {}
        self.transfer_errors: list[Exception] = []

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: int | None = None,
        kv_transfer_params: Any = None,
    ) -> int:
        """Queue a request; with ``kv_transfer_params`` (a ``KvTransferParams`` or its dict) its
        prompt's K/V are read from the prefill instance they name. ``InvalidArgumentError``
        (nothing queued) for malformed params, params for other tokens or another peer."""
        if kv_transfer_params is None:
            return super().add_request(prompt_ids, params, request_id)
        kvp = (
            kv_transfer_params
            if isinstance(kv_transfer_params, KvTransferParams)
            else KvTransferParams.from_dict(kv_transfer_params)
        )
        ids = prompt_token_ids(prompt_ids, self.model.config.vocab_size)
        if kvp.num_tokens > len(ids):
            raise InvalidArgumentError(f"the params cover {kvp.num_tokens} tokens, the prompt has {len(ids)}")
        if self.peer is not None and (kvp.host, kvp.port) != self.peer:
            raise InvalidArgumentError(
                f"the params name {kvp.host}:{kvp.port}; this engine reads from "
                f"{self.peer[0]}:{self.peer[1]} only (kv_peer)"
            )
        if kvp.block_size != self.config.block_size or kvp.num_groups != self.layout.num_groups:
            raise InvalidArgumentError(
                f"the params' blocks ({kvp.block_size} tokens, {kvp.num_groups} KV groups) do not "
                f"match this engine's ({self.config.block_size}, {self.layout.num_groups})"
            )
        rid = super().add_request(ids, params, request_id)
        seq = self.requests[rid].sequences[0]
        self.scheduler.waiting.remove(seq)  # it runs once its blocks are in
        self._awaiting[seq.seq_id] = _Awaiting(seq, kvp)
        return rid

    def has_unfinished(self) -> bool:
        return bool(self._awaiting) or super().has_unfinished()

    def step(self) -> list[Any]:
        self._start_reads()
        for result in self.sink.poll():
            self._admit(result)
        self._renew()
        if self._awaiting:
            # Requests waiting for their blocks are progress the scheduler does not see: its
            # guard against a step that changes nothing counts scheduler work only.
            self._idle_steps = 0
        return super().step()

    def _start_reads(self) -> None:
        """Admit the awaiting requests, oldest first, while the pool and ``max_num_seqs`` allow."""
        c = self.config
        for entry in list(self._awaiting.values()):
            if entry.started:
                continue
            running = len(self.scheduler.running) + sum(e.started for e in self._awaiting.values())
            if running >= c.max_num_seqs:
                return
            seq = entry.seq
            tokens = np.array(seq.token_ids, dtype=np.int64)
            try:
                cached = self.kv.add_sequence(seq.seq_id, tokens, num_scheduled=0)
            except OutOfBlocksError:
                return  # its blocks come free as others finish
            except PagedKvError as error:
                del self._awaiting[seq.seq_id]
                self._fail(seq.request, error, time.perf_counter())
                continue
            entry.started, entry.cached = True, cached
            dst, skip = destination_block_ids(self.kv, seq.seq_id, entry.params, cached)
            self.sink.start(entry.params, dst, skip=skip, request_id=str(seq.seq_id))

    def _admit(self, result: TransferResult) -> None:
        """The read is done: advance over the intact tokens and let the scheduler run the rest."""
        entry = self._awaiting.pop(int(result.request_id))
        seq, kvp, cached = entry.seq, entry.params, entry.cached
        prompt = len(seq.token_ids)
        valid = max(cached, min(result.num_valid_tokens, prompt - 1))
        held_blocks = cached // self.config.block_size
        if any(kvp.first_position(g) > held_blocks for g in range(kvp.num_groups)):
            valid = cached  # unsent window positions must not enter the prefix index
        if valid > cached:
            self.kv.advance_computed([seq.seq_id], valid - cached)
        record = TransferRecord(
            blocks_read=result.blocks_read,
            blocks_skipped=result.blocks_skipped,
            blocks_failed=result.num_failed,
            tokens_received=valid - cached,
            cached_tokens=cached,
            error=None if result.error is None else f"{type(result.error).__name__}: {result.error}",
        )
        if result.error is not None:
            self.transfer_errors.append(result.error)
        self.transfers[seq.request.request_id] = record
        seq.request.cached_tokens = valid
        seq.status = SeqStatus.RUNNING
        seq.admitted = self.scheduler._next_admission()
        self.scheduler.running.append(seq)

    def _renew(self) -> None:
        """Keep the prefill side's lease on the requests still waiting to be read."""
        now = time.monotonic()
        for entry in self._awaiting.values():
            if not entry.started and now - entry.renewed_s > entry.params.lease_s / 3:
                entry.renewed_s = now
                self.sink.renew(entry.params)

    @property
    def blocks_sent(self) -> int:
        return int(self.sink.blocks_read)

    @property
    def blocks_skipped(self) -> int:
        return int(self.sink.blocks_skipped)

    def close(self, timeout_s: float = 5.0) -> bool:
        self.sink.close()
        return super().close(timeout_s)
