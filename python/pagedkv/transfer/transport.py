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
import time
from collections.abc import Callable, Iterator
from typing import Any

from pagedkv.errors import TransferError, TransportUnavailableError

__all__ = ["load_nixl", "new_agent", "nixl_failures", "wait_until"]


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
    port). ``num_threads`` > 0 gives the backend worker threads, so posting a transfer returns
    at once instead of copying in the caller's thread (docs/transfer.md, The transport)."""
    api = load_nixl()
    config = api.nixl_agent_config(
        enable_listen_thread=True, listen_port=port, backends=["UCX"], num_threads=num_threads
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
