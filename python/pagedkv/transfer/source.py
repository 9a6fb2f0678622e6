"""``TransferSource``: the prefill side (docs/transfer.md, The protocol, steps 1 and 5).

It registers the instance's cache regions and its handshake page with a NIXL agent whose
listener serves the agent's metadata on ``port``. When a request's prefill is done, the engine
calls ``offer``: the blocks' checksums are computed, the request goes under lease, and the
returned ``KvTransferParams`` go to the decode side (through whatever carries the request: a
proxy, a router). The engine keeps the request's blocks allocated and unwritten until the
injected ``free_request(request_id)`` is called, which ``poll`` does when the decode side's
notification arrives or the lease runs out (``PendingSends``). The engine calls ``poll`` every
step while anything is pending; it never blocks.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from pagedkv.errors import InvalidArgumentError
from pagedkv.transfer.checksum import block_checksums
from pagedkv.transfer.leases import PendingSends
from pagedkv.transfer.messages import decode_notification
from pagedkv.transfer.params import KvTransferParams
from pagedkv.transfer.regions import KvRegions
from pagedkv.transfer.staging import StagingArena, pack_blocks
from pagedkv.transfer.transport import Progress, new_agent, nixl_failures

__all__ = ["Released", "TransferSource"]


@dataclass(frozen=True)
class Released:
    """What one ``poll`` freed: requests the decode side is done with (``completed``: read, or
    abandoned) and requests whose lease ran out (``expired``)."""

    completed: tuple[str, ...]
    expired: tuple[str, ...]


class TransferSource:
    """The prefill side of KV transfer for one instance's caches.

    regions: the caches (``KvRegions``); engine_id: this engine's name (in every params);
    free_request: called once per offered request when its blocks may be freed; port: the NIXL
    listener's port, which the decode side connects to (``host`` is the address the params
    advertise for it); lease_s: how long blocks wait for a decode side without a renewal;
    clock: the lease clock (seconds, monotonic); num_threads: NIXL backend threads (0 is fine
    here: the prefill side posts no transfers); staging_bytes: a staging arena of this many
    bytes (0: none): ``offer`` copies a request's blocks into it block-major when they fit, so
    a decode side with an arena of its own reads them in a few large reads instead of one per
    block row (docs/transfer.md, Staged reads). The range is given back with the blocks.
    """

    def __init__(
        self,
        regions: KvRegions,
        *,
        engine_id: str,
        free_request: Callable[[str], object],
        port: int,
        host: str = "127.0.0.1",
        lease_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        num_threads: int = 0,
        staging_bytes: int = 0,
    ) -> None:
        if not isinstance(regions, KvRegions):
            raise InvalidArgumentError(f"regions must be a KvRegions, got {type(regions).__name__}")
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise InvalidArgumentError(f"port must be in [1, 65535], got {port!r}")
        self.regions = regions
        self.engine_id = engine_id
        self.host = host
        self.port = port
        self.instance = secrets.token_hex(8)
        self._free_request = free_request
        self._pending = PendingSends(self._release, lease_s=lease_s, clock=clock)
        self._arena = StagingArena(staging_bytes) if staging_bytes else None
        self._staged: dict[str, int] = {}  # request id -> its staging range's offset
        # Validates the engine id, host and lease the way every params will carry them.
        KvTransferParams(
            engine_id, self.instance, "-", host, port, 0, regions.block_size, ((),), ((),), 1, 1, lease_s
        )
        self._page = np.frombuffer(regions.layout_page(engine_id, self.instance), dtype=np.uint8).copy()
        self._agent: Any = new_agent(f"{engine_id}#{self.instance}", port=port, num_threads=num_threads)
        memory = [*regions.registrations(), (int(self._page.ctypes.data), int(self._page.nbytes), 0, "")]
        if self._arena is not None:
            memory.append((self._arena.address, self._arena.nbytes, 0, ""))
        with nixl_failures("registering the caches with NIXL"):
            self._registered = self._agent.register_memory(memory, "DRAM")
        self._progress = Progress(self._agent)
        self.requests_offered = 0
        self.blocks_offered = 0
        self.bad_notifications = 0

    @property
    def pending(self) -> PendingSends:
        """The requests under lease (read-only use: ``len``, ``in``, ``deadline``, counters)."""
        return self._pending

    def offer(self, request_id: str, block_ids: Sequence[Sequence[int]], num_tokens: int) -> KvTransferParams:
        """Hand a prefilled request out: ``block_ids[g]`` are its blocks in KV group ``g`` for its
        last ``len(block_ids[g])`` logical positions (``source_block_ids`` reads them off a
        manager), ``num_tokens`` the tokens they hold. The blocks must hold their final
        contents: the checksums are taken now. With int4 caches only whole blocks are sent and
        ``num_tokens`` is cut to them (the unfilled block lives in a residual slot). Raises
        ``InvalidArgumentError`` (nothing changes) for a malformed call or a request id pending."""
        if request_id in self._pending:
            raise InvalidArgumentError(f"request {request_id!r} is already offered")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise InvalidArgumentError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        if isinstance(block_ids, (str, bytes)) or not isinstance(block_ids, Sequence) or not block_ids:
            raise InvalidArgumentError("block_ids is a list with one list of block ids per KV group")
        bs = self.regions.block_size
        groups = []
        for g, ids in enumerate(block_ids):
            array = np.asarray(ids)
            if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
                raise InvalidArgumentError(f"block_ids[{g}] must be a 1-D list of ints")
            self.regions.check_block_ids(array, f"block_ids[{g}]")
            groups.append([int(b) for b in array])
        if self.regions.sealed_blocks_only and num_tokens % bs:
            # Every group's list ends at the last, unfilled block: drop it everywhere.
            num_tokens -= num_tokens % bs
            groups = [ids[:-1] for ids in groups]
        all_ids = np.asarray([b for ids in groups for b in ids], dtype=np.int64)
        block_nbytes = self.regions.block_nbytes
        offset = (
            None
            if self._arena is None or not all_ids.size
            else self._arena.allocate(all_ids.size * block_nbytes)
        )
        try:
            if offset is None:
                sums = block_checksums(self.regions.arrays, all_ids)
                staged_addr = staged_nbytes = 0
            else:
                assert self._arena is not None
                staged_nbytes = int(all_ids.size) * block_nbytes
                staged = self._arena.array[offset : offset + staged_nbytes].reshape(-1, block_nbytes)
                pack_blocks(self.regions.arrays, all_ids, staged)
                sums = [xxhash.xxh3_64_intdigest(row.data) for row in staged]  # = block_checksums
                staged_addr = self._arena.address + offset
            cuts = np.cumsum([0, *map(len, groups)])
            params = KvTransferParams(
                engine_id=self.engine_id,
                instance=self.instance,
                request_id=request_id,
                host=self.host,
                port=self.port,
                num_tokens=num_tokens,
                block_size=bs,
                block_ids=tuple(tuple(ids) for ids in groups),
                checksums=tuple(tuple(sums[a:b]) for a, b in zip(cuts, cuts[1:], strict=False)),
                layout_addr=int(self._page.ctypes.data),
                layout_nbytes=int(self._page.nbytes),
                lease_s=self._pending.lease_s,
                staged_addr=staged_addr,
                staged_nbytes=staged_nbytes,
            )
            self._pending.add(request_id)
        except BaseException:
            if offset is not None:
                assert self._arena is not None
                self._arena.release(offset)
            raise
        if offset is not None:
            self._staged[request_id] = offset
        self.requests_offered += 1
        self.blocks_offered += params.num_blocks
        return params

    def _release(self, request_id: str) -> None:
        offset = self._staged.pop(request_id, None)
        if offset is not None:
            assert self._arena is not None
            self._arena.release(offset)
        self._free_request(request_id)

    def poll(self) -> Released:
        """Take the decode sides' notifications (free on ``done``/``abandon``, extend on
        ``renew``; anything else is counted in ``bad_notifications``) and free the requests
        whose lease ran out."""
        notifications = self._progress.take_notifications()
        completed: list[str] = []
        for messages in notifications.values():
            for message in messages:
                note = decode_notification(message)
                if note is None:
                    self.bad_notifications += 1
                    continue
                for request_id in note.request_ids:
                    if note.kind == "renew":
                        self._pending.renew(request_id)
                    elif self._pending.complete(request_id):
                        completed.append(request_id)
        expired = self._pending.expire()
        return Released(tuple(completed), tuple(expired))

    def abort(self, request_id: str) -> bool:
        """Free an offered request now (the engine drops it); False if it is not pending."""
        return self._pending.abort(request_id)

    def close(self) -> None:
        """Free every pending request and drop the agent (its listener stops). Idempotent."""
        if self._agent is None:
            return
        try:
            self._pending.release_all()
        finally:
            self._progress.stop()
            agent, self._agent = self._agent, None
            try:
                agent.deregister_memory(self._registered)
            except Exception:  # NIXL's own classes: the agent goes away regardless
                pass
            del agent

    def __enter__(self) -> TransferSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
