"""Queued store puts outlive the process that queued them: at interpreter exit an ``atexit``
hook runs every live engine's store worker dry (``OffloadWorker.close``, draining), within
``EXIT_FLUSH_S`` seconds for all of them together.

An engine whose caller never closes it (``LLMEngine`` without ``close()``, a ``LLM.stream``
abandoned before its end) otherwise loses the puts still queued when the process ends: the
worker is a daemon thread, stopped where it is. ``LLM.generate`` closes its engine itself, and
``with LLM(...) as llm:`` closes whatever is still open. Puts still queued when the bound runs
out are dropped and counted (``OffloadWorker.dropped_puts``); a process killed by a signal runs
no hook at all.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedkv.offload import OffloadWorker

__all__ = ["EXIT_FLUSH_S", "flush_all", "flush_at_exit"]

# The most the interpreter's exit waits for queued puts, all workers together: a SmolLM2 block
# is 737,280 bytes, so even a slow store writes a few hundred queued blocks in this time.
EXIT_FLUSH_S = 10.0

_lock = threading.Lock()
# Weak: a worker's own thread keeps it alive while it runs, and a closed one may go.
_workers: weakref.WeakSet[OffloadWorker] = weakref.WeakSet()


def flush_at_exit(worker: OffloadWorker) -> None:
    """Write ``worker``'s queued puts when the interpreter exits (unless it is closed first)."""
    with _lock:
        _workers.add(worker)


def flush_all(timeout_s: float = EXIT_FLUSH_S) -> bool:
    """Close every registered worker, draining its puts, within ``timeout_s`` in all; ``True``
    when every one stopped with nothing left behind."""
    end = time.monotonic() + timeout_s
    with _lock:
        workers = list(_workers)
        _workers.clear()
    done = True
    for worker in workers:
        dropped = worker.dropped_puts
        stopped = worker.close(max(0.0, end - time.monotonic()))
        done = done and stopped and worker.dropped_puts == dropped
    return done


atexit.register(flush_all)
