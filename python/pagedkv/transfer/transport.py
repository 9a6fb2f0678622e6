"""The NIXL transport: loading it, making an agent, turning its failures into ``TransferError``.

NIXL (``pip install 'pagedkv[transfer]'``) moves the bytes: its UCX backend reads registered
host memory of another process (on one machine through cross-memory attach, across machines
over TCP or RDMA) and delivers notifications; its listener thread serves an agent's metadata
(``fetch_remote_metadata``). Every agent runs the listener: the side that fetches needs it too,
to receive the answer (port 0 picks a free port where nobody connects to it first). Why NIXL
and not a home-made socket protocol: docs/transfer.md, The transport.

NIXL logs each agent's creation at INFO on stdout; unless ``NIXL_LOG_LEVEL`` says otherwise,
loading it here lowers its Python logger to WARNING (a library does not print).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from pagedkv.errors import TransferError, TransportUnavailableError

__all__ = ["Progress", "load_nixl", "new_agent", "nixl_failures", "wait_until"]


def load_nixl() -> Any:
    """The ``nixl._api`` module, or ``TransportUnavailableError`` saying how to install it."""
    try:
        from nixl import _api
    except ImportError as error:
        raise TransportUnavailableError(
            f"KV transfer needs NIXL: pip install 'pagedkv[transfer]' ({error})"
        ) from error
    if not os.environ.get("NIXL_LOG_LEVEL"):
        logging.getLogger("nixl").setLevel(logging.WARNING)
    return _api


@contextlib.contextmanager
def nixl_failures(what: str) -> Iterator[None]:
    """Re-raise whatever a NIXL call raises (its own exception classes, or RuntimeError from
    the bindings) as ``TransferError`` naming ``what``, the cause chained."""
    try:
        yield
    except TransferError:
        raise
    except Exception as error:  # NIXL's classes have no common base but Exception
        raise TransferError(f"{what}: {type(error).__name__}: {error}") from error


def new_agent(name: str, *, port: int, num_threads: int = 0) -> Any:
    """A NIXL agent with the UCX backend and its metadata listener on ``port`` (0: any free
    port), without NIXL's own progress thread (it polls without pause: most of a core per
    agent, measured; ``Progress`` drives the agent instead). ``num_threads`` > 0 gives the
    backend worker threads (docs/transfer.md, The transport)."""
    api = load_nixl()
    config = api.nixl_agent_config(
        enable_prog_thread=False,
        enable_listen_thread=True,
        listen_port=port,
        backends=["UCX"],
        num_threads=num_threads,
    )
    with nixl_failures(f"creating NIXL agent {name!r} listening on port {port}"):
        agent = api.nixl_agent(name, config)
    if "UCX" not in agent.backends:
        raise TransportUnavailableError("NIXL's UCX backend plugin did not load")
    return agent


def wait_until(done: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``done`` (1 ms apart) until it is true; ``TransferError`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TransferError(f"{what}: no answer within {timeout_s} s")
        time.sleep(0.001)


class Progress:
    """Drives an agent's transport from a daemon thread every ``interval_s``: a peer's
    connection set-up and reads of our memory need our side to answer, whenever the owner
    next calls in. Each round takes the notifications that arrived (``take_notifications``
    hands them over; with ``keep_notifications`` False they are dropped: a side that expects
    none). One lock serialises the rounds with the owner's calls that touch notifications."""

    def __init__(self, agent: Any, *, interval_s: float = 0.001, keep_notifications: bool = True) -> None:
        self._agent = agent
        self._interval_s = interval_s
        self._keep = keep_notifications
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self.failures = 0
        self._thread = threading.Thread(target=self._run, name="pagedkv-transfer-progress", daemon=True)
        self._thread.start()

    def _round(self) -> None:
        if self._keep:
            self._agent.update_notifs()  # progresses the worker; appends to agent.notifs
        else:
            self._agent.get_new_notifs()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                with self.lock:
                    self._round()
            except Exception:  # NIXL's own classes: counted; the owner's next call reports it
                self.failures += 1

    def take_notifications(self) -> dict[str, list[bytes]]:
        """Every notification that arrived since the last call, by sender."""
        with self.lock, nixl_failures("reading NIXL notifications"):
            self._agent.update_notifs()
            notifications: dict[str, list[bytes]] = self._agent.notifs
            self._agent.notifs = {}
        return notifications

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
