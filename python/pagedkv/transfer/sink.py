"""``TransferSink``: the decode side (docs/transfer.md, The protocol, steps 2 to 4).

``start`` takes a request's params and where its blocks go: it completes the handshake with the
prefill instance (once per peer, then cached), posts one NIXL READ for every block of every
region and group the decode side lacks (one descriptor per block row, NIXL merging runs of
consecutive ids; or, for a request the prefill side staged, a few reads of its block-major copy
into our own staging arena) with the ``done`` notification attached (NIXL delivers it once the
data has been read), and returns. ``poll`` finishes what has completed: it recomputes each block's
checksum over the rows received and returns a ``TransferResult`` per request; a block whose sum
differs, or every block of a read that failed or ran past ``timeout_s``, is reported failed
(``failed_block_ids``, and ``get_block_ids_with_load_errors``, vLLM's meaning) so the engine
recomputes it. Transport failures are results, never exceptions; a malformed call is an
``InvalidArgumentError`` and starts nothing.

Without backend threads (``num_threads=0``) NIXL copies a read between two processes of one
machine inside the posting call, so ``start`` returns when the bytes are there; with threads it
returns at once and ``poll`` finds the read done later.
"""

from __future__ import annotations

import ctypes
import secrets
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from pagedkv.errors import InvalidArgumentError, TransferError
from pagedkv.transfer.checksum import block_checksum
from pagedkv.transfer.messages import encode_notification
from pagedkv.transfer.params import KvTransferParams
from pagedkv.transfer.peer import PageBuffer, Peer, forget_peer, handshake
from pagedkv.transfer.read_plan import ReadPlan
from pagedkv.transfer.regions import KvRegions
from pagedkv.transfer.result import TransferResult
from pagedkv.transfer.staging import StagingArena, unpack_blocks
from pagedkv.transfer.transport import Progress, new_agent, nixl_failures

__all__ = ["TransferSink"]


@dataclass
class _Read:
    request_id: str
    plan: ReadPlan
    peer: Peer
    handle: Any
    state: str
    started: float
    deadline: float
    staging: int | None = None  # the offset of its range in our staging arena (staged reads)
    error: TransferError | None = None  # set once the read has failed; kept until released
    abandoned: bool = False  # the prefill side was told (the read ran past its timeout)


class TransferSink:
    """The decode side of KV transfer for one instance's caches.

    regions: the caches the blocks are read into (same regions, row sizes and dtypes as the
    prefill side's); engine_id: this engine's name; timeout_s: how long one read may take before
    it is given up; handshake_timeout_s: how long a peer's metadata and handshake page may take;
    num_threads: NIXL backend threads (see the module docstring); staging_bytes: a staging
    arena of this many bytes (0: none): a request the prefill side staged is read into it in a
    few large reads, checked there, and only its intact blocks are copied into the caches (when
    it does not fit, or was not staged, its blocks are read row by row). One thread drives it.
    """

    def __init__(
        self,
        regions: KvRegions,
        *,
        engine_id: str,
        timeout_s: float = 30.0,
        handshake_timeout_s: float = 5.0,
        num_threads: int = 0,
        staging_bytes: int = 0,
    ) -> None:
        if not isinstance(regions, KvRegions):
            raise InvalidArgumentError(f"regions must be a KvRegions, got {type(regions).__name__}")
        for name, value in (("timeout_s", timeout_s), ("handshake_timeout_s", handshake_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise InvalidArgumentError(f"{name} must be a positive number, got {value!r}")
        if not isinstance(engine_id, str) or not engine_id:
            raise InvalidArgumentError("engine_id must be a non-empty str")
        self.regions = regions
        self.engine_id = engine_id
        self.timeout_s = float(timeout_s)
        self.handshake_timeout_s = float(handshake_timeout_s)
        self._agent: Any = new_agent(f"{engine_id}#{secrets.token_hex(8)}", port=0, num_threads=num_threads)
        with nixl_failures("registering the caches with NIXL"):
            self._registered = self._agent.register_memory(regions.registrations(), "DRAM")
            self._local = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", regions.descriptors(), "DRAM")
        self._page = PageBuffer(self._agent)
        self._progress = Progress(self._agent, keep_notifications=False)  # a decode side gets none
        self._arena = StagingArena(staging_bytes) if staging_bytes else None
        if self._arena is not None:
            with nixl_failures("registering the staging arena with NIXL"):
                self._arena_registration = self._agent.register_memory(
                    [(self._arena.address, self._arena.nbytes, 0, "")], "DRAM"
                )
        self._peers: dict[str, Peer] = {}
        self._reads: dict[str, _Read] = {}
        self._finished: dict[str, TransferResult] = {}
        self._load_errors: set[int] = set()
        self.blocks_read = 0
        self.blocks_skipped = 0
        self.blocks_failed = 0

    # -- peers ---------------------------------------------------------------------------
    def _peer(self, params: KvTransferParams, *, abandon: bool) -> Peer:
        peer = self._peers.get(params.agent_name)
        if peer is not None:
            return peer
        for stale in [p for p in self._peers.values() if p.engine_id == params.engine_id]:
            self._forget(stale)  # the engine restarted: its old incarnation is gone
        try:
            peer = handshake(
                self._agent, self.regions, self._page, params, timeout_s=self.handshake_timeout_s
            )
        except TransferError:
            if abandon:  # the peer may be reachable even though we cannot read from it
                self._send(params.agent_name, "abandon", [params.request_id])
            forget_peer(self._agent, params.agent_name, None)
            raise
        self._peers[peer.agent_name] = peer
        return peer

    def _forget(self, peer: Peer) -> None:
        if self._peers.get(peer.agent_name) is peer and not any(r.peer is peer for r in self._reads.values()):
            del self._peers[peer.agent_name]
            forget_peer(self._agent, peer.agent_name, peer.descriptors)

    def _notify(self, peer: Peer, kind: str, request_ids: Sequence[str]) -> bool:
        return self._send(peer.agent_name, kind, request_ids)

    def _send(self, agent_name: str, kind: str, request_ids: Sequence[str]) -> bool:
        try:
            with nixl_failures(f"notifying {agent_name}"):
                self._agent.send_notif(agent_name, encode_notification(kind, request_ids))
            return True
        except TransferError:
            return False  # the lease frees the prefill side's blocks instead

    # -- the API -------------------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        """Reads started and not yet returned by ``poll``."""
        return len(self._reads)

    def start(
        self,
        params: KvTransferParams | Mapping[str, Any],
        dst_block_ids: Sequence[Sequence[int] | np.ndarray],
        *,
        skip: Sequence[Iterable[int]] | None = None,
        request_id: str | None = None,
    ) -> str:
        """Start reading a request's blocks; returns the id its result will carry
        (``request_id``, default the params' own). ``dst_block_ids[g][i]`` receives
        ``params.block_ids[g][i]`` unless ``i`` is in ``skip[g]`` (blocks already held or not
        needed: never written). With nothing to read, the prefill side is told at once."""
        if not isinstance(params, KvTransferParams):
            params = KvTransferParams.from_dict(params)
        plan = ReadPlan.build(params, dst_block_ids, skip, self.regions.num_blocks)
        rid = params.request_id if request_id is None else request_id
        if not isinstance(rid, str) or not rid:
            raise InvalidArgumentError(f"request_id must be a non-empty str, got {rid!r}")
        if rid in self._reads or rid in self._finished:
            raise InvalidArgumentError(f"request {rid!r} is already being read")
        try:
            peer = self._peer(params, abandon=True)
        except TransferError as unreachable:
            self._finish(rid, plan, np.ones(plan.num_reads, dtype=bool), unreachable)
            return rid
        if plan.num_reads == 0:
            self._notify(peer, "done", [params.request_id])
            self._finish(rid, plan, np.zeros(0, dtype=bool), None)
            return rid
        layout = peer.layout
        if int(plan.src.max()) >= layout.num_blocks:
            error = TransferError(
                f"{peer.agent_name}'s params name block {int(plan.src.max())} of {layout.num_blocks}"
            )
            self._notify(peer, "abandon", [params.request_id])
            self._finish(rid, plan, np.ones(plan.num_reads, dtype=bool), error)
            return rid
        staging = self._stage(plan)
        now = time.monotonic()
        handle = None
        try:
            with nixl_failures(f"reading {params.request_id} from {peer.agent_name}"):
                notification = encode_notification("done", [params.request_id])
                if staging is None:
                    local, remote = plan.descriptor_indices(
                        len(self.regions.specs), self.regions.num_blocks, layout.num_blocks
                    )
                    handle = self._agent.make_prepped_xfer(
                        "READ", self._local, local, peer.descriptors, remote, notif_msg=notification
                    )
                else:
                    local_rows, remote_rows = self._staged_descriptors(plan, staging)
                    handle = self._agent.initialize_xfer(
                        "READ",
                        self._agent.get_xfer_descs(local_rows, "DRAM"),
                        self._agent.get_xfer_descs(remote_rows, "DRAM"),
                        peer.agent_name,
                        notification,
                    )
                state = self._agent.transfer(handle)
        except TransferError as refused:
            read = _Read(rid, plan, peer, handle, "ERR", now, now + self.timeout_s, staging, refused)
        else:
            read = _Read(rid, plan, peer, handle, state, now, now + self.timeout_s, staging)
        self._reads[rid] = read
        self._advance(read)
        return rid

    def _stage(self, plan: ReadPlan) -> int | None:
        """A range of our arena for a staged read of ``plan``, or None (read row by row): the
        prefill side did not stage, its staged rows are not our blocks' size, or no room."""
        params = plan.params
        bn = self.regions.block_nbytes
        if self._arena is None or not params.staged_addr or params.staged_nbytes != params.num_blocks * bn:
            return None
        return self._arena.allocate(plan.num_reads * bn)

    def _staged_descriptors(self, plan: ReadPlan, offset: int) -> tuple[np.ndarray, np.ndarray]:
        """(local, remote) uint64 ``[num_reads, 3]``: read ``i`` is row ``plan.index[i]`` of the
        peer's staged copy into row ``i`` of our range (neighbours on both sides: NIXL merges
        every run the skipped positions leave into one read)."""
        assert self._arena is not None
        bn = self.regions.block_nbytes
        local = np.zeros((plan.num_reads, 3), dtype=np.uint64)
        local[:, 0] = self._arena.address + offset + bn * np.arange(plan.num_reads, dtype=np.uint64)
        local[:, 1] = bn
        remote = local.copy()
        remote[:, 0] = plan.params.staged_addr + bn * plan.index.astype(np.uint64)
        return local, remote

    def poll(self) -> list[TransferResult]:
        """Finish every read that completed, failed or timed out; returns their results (and
        those finished since the last call)."""
        for read in list(self._reads.values()):
            self._advance(read)
        done = list(self._finished.values())
        self._finished.clear()
        return done

    def wait(self, request_id: str, timeout_s: float | None = None) -> TransferResult:
        """Poll until ``request_id``'s result is in and return it (others stay for ``poll``);
        ``TransferError`` if it is not in within ``timeout_s`` (default: the read's own
        timeout plus a second). ``InvalidArgumentError`` for an id never started."""
        if request_id not in self._reads and request_id not in self._finished:
            raise InvalidArgumentError(f"no read of {request_id!r} in flight")
        limit = time.monotonic() + (self.timeout_s + 1.0 if timeout_s is None else timeout_s)
        while request_id not in self._finished:
            read = self._reads.get(request_id)
            if read is not None:
                self._advance(read)
            if request_id in self._finished:
                break
            if time.monotonic() > limit:
                raise TransferError(f"the read of {request_id!r} is still in flight after the wait")
            time.sleep(0.0005)
        return self._finished.pop(request_id)

    def connect(self, params: KvTransferParams | Mapping[str, Any]) -> None:
        """Complete the handshake with the prefill instance ``params`` names now (``start``
        does it on first use otherwise): an engine may call it as a request arrives, before
        it has blocks for it. ``TransferError`` if the peer cannot be reached or does not
        match; cached per peer."""
        if not isinstance(params, KvTransferParams):
            params = KvTransferParams.from_dict(params)
        self._peer(params, abandon=False)

    def renew(self, params: KvTransferParams | Mapping[str, Any]) -> bool:
        """Ask the prefill side to extend the request's lease (a heartbeat while the request
        waits on this side); False if the peer cannot be reached."""
        if not isinstance(params, KvTransferParams):
            params = KvTransferParams.from_dict(params)
        try:
            peer = self._peer(params, abandon=False)
        except TransferError:
            return False
        return self._notify(peer, "renew", [params.request_id])

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The decode side's block ids that failed to load since the last call (vLLM's
        ``get_block_ids_with_load_errors``): recompute them, never attend over them."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        """Wait (up to ``timeout_s``) for the reads in flight to end, then drop every peer and
        the agent. Idempotent. A read still in flight after that keeps this sink, its agent and
        its registered caches alive for the process's life (the agent is never destroyed:
        destroying it could land the read in memory given back, or abort in NIXL)."""
        if self._agent is None:
            return
        deadline = time.monotonic() + self.timeout_s
        while self._reads and time.monotonic() < deadline:
            for read in list(self._reads.values()):
                self._advance(read)
            time.sleep(0.001)
        if self._reads:
            _KEEP_ALIVE.append(self)
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(self._agent))  # never deallocated
            return
        self._reads.clear()
        for peer in list(self._peers.values()):
            forget_peer(self._agent, peer.agent_name, peer.descriptors)
        self._peers.clear()
        self._progress.stop()
        agent, self._agent = self._agent, None
        try:
            self._local.release()
            agent.deregister_memory(self._registered)
            agent.deregister_memory(self._page.registration)
            if self._arena is not None:
                agent.deregister_memory(self._arena_registration)
        except Exception:  # NIXL's own classes: the agent goes away regardless
            pass
        del agent

    def __enter__(self) -> TransferSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- finishing a read ----------------------------------------------------------------
    def _advance(self, read: _Read) -> None:
        """Finish ``read`` if the transport is done with it. A read is never cancelled: NIXL's
        UCX backend can abort the process when an agent whose read was cancelled is destroyed
        (measured with backend threads, docs/transfer.md, Failure handling), and a read that
        might still write must keep its destination blocks anyway. Past ``timeout_s`` the read
        is given up (its blocks will be reported failed, the prefill side is told at once) and
        reported when the transport lets go of it (it ends, or errors: a dead peer is detected)."""
        if read.state == "PROC":
            try:
                with nixl_failures(f"reading {read.plan.params.request_id} from {read.peer.agent_name}"):
                    read.state = self._agent.check_xfer_state(read.handle)
            except TransferError as failure:
                read.error = read.error or failure
                read.state = "ERR"
            if read.state == "PROC":
                if read.error is None and time.monotonic() > read.deadline:
                    read.error = TransferError(
                        f"the read from {read.peer.agent_name} ran past {self.timeout_s} s"
                    )
                    self._notify(read.peer, "abandon", [read.plan.params.request_id])
                    read.abandoned = True
                return
        if read.error is None and read.state == "ERR":
            read.error = TransferError(f"the transport failed reading from {read.peer.agent_name}")
        if read.handle is not None:
            try:
                with nixl_failures("releasing a finished read"):
                    read.handle.release()
            except TransferError:
                return  # not let go yet: try again at the next poll
            read.handle = None
        read_s = time.monotonic() - read.started
        del self._reads[read.request_id]
        plan = read.plan
        if read.error is not None:
            self._release_staging(read)
            if not read.abandoned:
                self._notify(read.peer, "abandon", [plan.params.request_id])
            self._forget(read.peer)  # it may be dead: the next request handshakes anew
            self._finish(read.request_id, plan, np.ones(plan.num_reads, dtype=bool), read.error, read_s)
            return
        verify_start = time.monotonic()
        copy_s = 0.0
        if read.staging is None:
            arrays = self.regions.arrays
            sums = np.fromiter(
                (block_checksum(arrays, int(b)) for b in plan.dst), dtype=np.uint64, count=plan.num_reads
            )
            failed = sums != plan.checksums
            verify_s = time.monotonic() - verify_start
        else:
            assert self._arena is not None
            bn = self.regions.block_nbytes
            rows = self._arena.array[read.staging : read.staging + plan.num_reads * bn].reshape(-1, bn)
            sums = np.fromiter((xxhash.xxh3_64_intdigest(r.data) for r in rows), np.uint64, plan.num_reads)
            failed = sums != plan.checksums
            verify_s = time.monotonic() - verify_start
            if failed.any():  # a block that failed never reaches the caches
                rows, dst = rows[~failed], plan.dst[~failed]
            else:  # no temporary copy: a large one costs page faults (and compaction) here
                dst = plan.dst
            unpack_blocks(rows, self.regions.arrays, dst)
            copy_s = time.monotonic() - verify_start - verify_s
            self._release_staging(read)
        mismatch = None
        if failed.any():
            mismatch = TransferError(
                f"{int(failed.sum())} of {plan.num_reads} blocks read from {read.peer.agent_name} "
                "do not match their checksums"
            )
        self._finish(read.request_id, plan, failed, mismatch, read_s, verify_s, copy_s)

    def _release_staging(self, read: _Read) -> None:
        if read.staging is not None:
            assert self._arena is not None
            self._arena.release(read.staging)
            read.staging = None

    def _finish(
        self,
        request_id: str,
        plan: ReadPlan,
        failed: np.ndarray,
        error: TransferError | None,
        read_s: float = 0.0,
        verify_s: float = 0.0,
        copy_s: float = 0.0,
    ) -> None:
        failed_ids = plan.failed_by_group(failed)
        self._load_errors.update(b for g in failed_ids for b in g)
        num_failed = int(failed.sum())
        self.blocks_read += plan.num_reads - num_failed
        self.blocks_skipped += plan.num_skipped
        self.blocks_failed += num_failed
        self._finished[request_id] = TransferResult(
            request_id=request_id,
            remote_request_id=plan.params.request_id,
            num_tokens=plan.params.num_tokens,
            blocks_read=plan.num_reads - num_failed,
            blocks_skipped=plan.num_skipped,
            failed_block_ids=failed_ids,
            num_valid_tokens=plan.num_valid_tokens(failed),
            error=error,
            read_s=read_s,
            verify_s=verify_s,
            copy_s=copy_s,
        )


_KEEP_ALIVE: list[TransferSink] = []
"""Sinks closed with a read still in flight: kept (with their caches) for the process's life so
the read never lands in freed memory."""
