"""``PrefillEngine``: computes each request's prompt, samples nothing it keeps, and hands the
prompt's K/V out (docs/transfer.md, The engine).

A request runs as an ordinary one-token request. When its first token is sampled the scheduler
would free its blocks; here a holder sequence forks them first (the manager's reference count
keeps them, shared with the prefix index), the blocks are offered (``TransferSource.offer``)
and the holder is freed when the decode side's notification arrives or the lease runs out. The
blocks of a held sequence are never written again: nothing appends to the holder, and a block
shared with the prefix index is copied before anyone else writes into it (copy-on-write).
"""

from __future__ import annotations

import dataclasses
import socket
from typing import Any

import numpy as np

from pagedkv.engine.config import EngineConfig, peer_address
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.scheduler import Scheduler
from pagedkv.engine.sequence import Sequence
from pagedkv.errors import InvalidArgumentError, TransferError
from pagedkv.models import LoadedModel
from pagedkv.transfer import KvRegions, KvTransferParams, TransferSource, source_block_ids

__all__ = ["PrefillEngine", "free_port", "make_engine"]

# Holder sequences live in their own id range, far above any the engine hands out.
HOLDER_BASE = 1 << 48


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now (the NIXL listener binds it right after)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# A port the engine picks itself is free when picked, but the kernel may hand it to an outgoing
# connection (NIXL's own, while the agent starts) before the listener binds it: pick again.
_PICKED_PORT_TRIES = 5


def _open_source(
    regions: KvRegions, free_request: Any, host: str, asked_port: int, lease_s: float
) -> TransferSource:
    """The engine's ``TransferSource`` on ``asked_port``, or on a port it picks (0 asked) with
    up to ``_PICKED_PORT_TRIES`` picks while the listener fails to start; a port the caller
    named is tried once, and any other failure is raised at once."""
    for attempt in range(1 if asked_port else _PICKED_PORT_TRIES):
        port = asked_port or free_port(host)
        try:
            return TransferSource(
                regions,
                engine_id=f"prefill@{host}:{port}",
                free_request=free_request,
                host=host,
                port=port,
                lease_s=lease_s,
            )
        except TransferError as error:
            if asked_port or attempt == _PICKED_PORT_TRIES - 1 or "listening on port" not in str(error):
                raise
    raise AssertionError("unreachable: the last try re-raises")


def offered_block_ids(kv: Any, seq_id: int, num_tokens: int) -> list[list[int]]:
    """Per KV group, the blocks to offer: a sliding-window group's whole history while the
    sequence still holds all of it (a prompt prefilled in one pass), else the window's blocks
    (``source_block_ids``). The whole history lets the decode side index every block it
    advances over; with the window only, it recomputes instead (``DecodeEngine``)."""
    windowed = source_block_ids(kv, seq_id, num_tokens)
    num_blocks = -(-num_tokens // kv.block_size)
    out = []
    for g, ids in enumerate(windowed):
        table = np.asarray(kv.block_table(seq_id, group=g))[:num_blocks]
        out.append([int(b) for b in table] if (table >= 0).all() else ids)
    return out


class _HoldingScheduler(Scheduler):
    """The scheduler, except that a finished sequence's blocks are first forked to a holder."""

    def __init__(self, engine: PrefillEngine, *args: Any) -> None:
        super().__init__(*args)
        self._engine = engine

    def finish(self, seq: Sequence) -> None:
        self._engine._hold(seq)
        super().finish(seq)


class PrefillEngine(LLMEngine):
    """An ``LLMEngine`` whose requests end after their prompt: ``offered[request_id]`` holds the
    ``KvTransferParams`` of each (JSON-safe, for the decode side) until ``take_offered``.
    ``step`` also serves the transfers (``TransferSource.poll``); call ``poll_transfers`` while
    idle. ``leaked_blocks``: blocks in use once nothing runs or waits to be read."""

    def __init__(self, model: LoadedModel, config: EngineConfig, *, lease_s: float = 30.0) -> None:
        if config.kv_role != "prefill":
            raise InvalidArgumentError(f"PrefillEngine needs kv_role='prefill', got {config.kv_role!r}")
        super().__init__(model, config)
        c = self.config
        self.scheduler = _HoldingScheduler(
            self, c, self.max_model_len, self.kv, self.layout, self.stats, self.store_lookup
        )
        host, asked_port = peer_address(c.kv_peer) if c.kv_peer else ("127.0.0.1", 0)
        regions = KvRegions.from_caches(self.store.k_caches, self.store.v_caches, block_size=c.block_size)
        self.source = _open_source(regions, self._release, host, asked_port, lease_s)
        self.offered: dict[int, dict[str, Any]] = {}
        self._holders: dict[str, int] = {}  # transfer request id -> holder seq id
        self._next_holder = HOLDER_BASE

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, request_id: int | None = None
    ) -> int:
        """Queue a prompt; it runs as one greedy-or-not sample of one token (the decode side
        samples every kept token itself)."""
        if not isinstance(params, SamplingParams):
            raise InvalidArgumentError(f"params must be SamplingParams, got {type(params).__name__}")
        one = dataclasses.replace(params, n=1, max_tokens=1, stop=(), ignore_eos=True)
        return super().add_request(prompt_ids, one, request_id)

    def _hold(self, seq: Sequence) -> None:
        """Fork ``seq``'s blocks to a holder and offer them; its prompt's K/V are all computed."""
        request = seq.request
        num_tokens = len(request.prompt_ids)
        holder = self._next_holder
        self._next_holder += 1
        self.kv.fork(seq.seq_id, holder)
        if self.kv.num_tokens(holder) > num_tokens:
            self.kv.truncate(holder, num_tokens)  # the sampled token is the decode side's
        rid = f"{self.source.instance}-{request.request_id}"
        self._holders[rid] = holder
        try:
            params: KvTransferParams = self.source.offer(
                rid, offered_block_ids(self.kv, holder, num_tokens), num_tokens
            )
        except BaseException:
            self._release(rid)
            raise
        self.offered[request.request_id] = params.to_dict()

    def _release(self, transfer_id: str) -> None:
        holder = self._holders.pop(transfer_id, None)
        if holder is not None and holder in self.kv:
            self.kv.free(holder)

    def take_offered(self, request_id: int) -> dict[str, Any]:
        """The params of a finished request, once (``KeyError`` if it has none)."""
        return self.offered.pop(request_id)

    def poll_transfers(self) -> None:
        """Free what the decode sides are done with, and what ran out of lease."""
        self.source.poll()

    @property
    def num_pending_transfers(self) -> int:
        return len(self.source.pending)

    @property
    def leaked_blocks(self) -> int:
        """Blocks still in use with nothing running and nothing offered (0 unless leaked)."""
        return self.kv.num_blocks - self.kv.num_free_blocks

    def step(self) -> list[Any]:
        events = super().step()
        self.source.poll()
        return events

    def close(self, timeout_s: float = 5.0) -> bool:
        """Free everything still offered and stop the listener, then the engine's own close."""
        self.source.close()
        return super().close(timeout_s)


def make_engine(model: LoadedModel, config: EngineConfig) -> LLMEngine:
    """The engine a config asks for: ``PrefillEngine``, ``DecodeEngine`` or ``LLMEngine``."""
    if config.kv_role == "prefill":
        return PrefillEngine(model, config)
    if config.kv_role == "decode":
        from pagedkv.disagg.decode_engine import DecodeEngine

        return DecodeEngine(model, config)
    return LLMEngine(model, config)
