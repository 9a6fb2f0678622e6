"""The decode side's handshake with one prefill instance, and its result cached per peer
(docs/transfer.md, The protocol, steps 2 and 3).

1. ``fetch_remote_metadata``: the peer's NIXL listener sends its agent metadata (connection
   info and its registered memory), which NIXL loads.
2. One READ of the peer's handshake page (``KvRegions.layout_page``, named by the params'
   ``layout_addr``/``layout_nbytes``): the addresses, row sizes and dtypes of its cache regions.
3. The page is checked against our own regions (same regions, row sizes and dtypes, same block
   size), and the peer's block descriptors are prepared once (``prep_xfer_dlist``): every later
   read from this peer only names descriptor indices.

Everything the peer sends is checked; a failure at any step is a ``TransferError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedkv.errors import TransferError
from pagedkv.transfer.params import MAX_LAYOUT_BYTES, KvTransferParams
from pagedkv.transfer.regions import KvRegions, RemoteLayout
from pagedkv.transfer.transport import nixl_failures, wait_until

__all__ = ["Peer", "PageBuffer", "forget_peer", "handshake"]


class PageBuffer:
    """The registered buffer a handshake page is read into (one per decode side)."""

    def __init__(self, agent: Any) -> None:
        self.array = np.zeros(MAX_LAYOUT_BYTES, dtype=np.uint8)
        self.address = int(self.array.ctypes.data)
        with nixl_failures("registering the handshake buffer"):
            self.registration = agent.register_memory([(self.address, self.array.nbytes, 0, "")], "DRAM")


@dataclass
class Peer:
    """A prefill instance we completed the handshake with."""

    agent_name: str
    engine_id: str
    layout: RemoteLayout
    descriptors: Any  # NIXL's prepared descriptor list of the peer's blocks


def handshake(
    agent: Any, local: KvRegions, page: PageBuffer, params: KvTransferParams, *, timeout_s: float
) -> Peer:
    """Steps 1-3 with the instance ``params`` names. On a ``TransferError`` the peer's metadata
    may be loaded: the caller may still notify it, then ``forget_peer``."""
    name = params.agent_name
    with nixl_failures(f"fetching {name}'s metadata from {params.host}:{params.port}"):
        agent.fetch_remote_metadata(name, params.host, params.port)
    wait_until(lambda: bool(agent.check_remote_metadata(name)), timeout_s, f"fetching {name}'s metadata")
    nbytes = params.layout_nbytes
    with nixl_failures(f"reading {name}'s handshake page"):
        # Connect now, so the first read of blocks does not pay for it.
        agent.make_connection(name)
        local_page = agent.get_xfer_descs([(page.address, nbytes, 0)], "DRAM")
        remote_page = agent.get_xfer_descs([(params.layout_addr, nbytes, 0)], "DRAM")
        handle = agent.initialize_xfer("READ", local_page, remote_page, name)
        state = agent.transfer(handle)
    try:
        _wait_done(agent, handle, state, timeout_s, f"reading {name}'s handshake page")
    finally:
        with nixl_failures("releasing the handshake read"):
            handle.release()
    layout = RemoteLayout.from_page(page.array[:nbytes].tobytes())
    layout.check_matches(local, params.engine_id, params.instance)
    with nixl_failures(f"preparing {name}'s block descriptors"):
        descriptors = agent.prep_xfer_dlist(name, layout.descriptors(), "DRAM")
    return Peer(name, params.engine_id, layout, descriptors)


def _wait_done(agent: Any, handle: Any, state: str, timeout_s: float, what: str) -> None:
    def done() -> bool:
        nonlocal state
        if state == "PROC":
            with nixl_failures(what):
                state = agent.check_xfer_state(handle)
        if state == "ERR":
            raise TransferError(f"{what}: the transport reported an error")
        return state == "DONE"

    wait_until(done, timeout_s, what)


def forget_peer(agent: Any, agent_name: str, descriptors: Any) -> None:
    """Drop a peer's prepared descriptors and metadata (best effort: a dead peer's may already
    be gone)."""
    if descriptors is not None:
        try:
            descriptors.release()
        except Exception:  # NIXL's own classes; nothing left to do about a failed release
            pass
    try:
        agent.remove_remote_agent(agent_name)
    except Exception:  # not loaded (the fetch never completed) or already invalidated
        pass
