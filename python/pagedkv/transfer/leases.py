"""``PendingSends``: the prefill side's requests whose blocks wait for a decode side to read
them, each under a lease (docs/transfer.md, The lease).

A request enters when the prefill side hands its params out (``add``) and leaves exactly once,
through one of four doors, each calling the injected ``free_request(request_id)`` (the engine's
manager call: ``kv.free(seq_id)`` of the request's sequence):

- ``complete``: the decode side's notification that it has read the blocks (or needs none);
- ``expire``: the lease ran out with no notification (the decode side died, never came, or
  gave up and its abandon notice was lost): a decode side that dies never leaks prefill blocks;
- ``abort``: the prefill engine drops the request itself;
- ``release_all``: the prefill side shuts down.

``renew`` (a decode side's heartbeat while the request waits in its queue) moves the deadline to
``now + lease_s`` if that is later. A notification for a request no longer pending (it
expired, or came twice) changes nothing and is counted. Pure bookkeeping on an injected clock:
no transport, no threads; the owner calls it from one thread.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from pagedkv.errors import InvalidArgumentError

__all__ = ["PendingSends"]


class PendingSends:
    """Requests under lease. ``free_request`` is called once per request that leaves, after it
    has left (an exception from it propagates, and the request stays gone: never freed twice)."""

    def __init__(
        self,
        free_request: Callable[[str], object],
        *,
        lease_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(lease_s, bool) or not isinstance(lease_s, (int, float)) or not 0 < lease_s < math.inf:
            raise InvalidArgumentError(f"lease_s must be a positive number, got {lease_s!r}")
        if not callable(free_request) or not callable(clock):
            raise InvalidArgumentError("free_request and clock must be callables")
        self._free_request = free_request
        self._clock = clock
        self.lease_s = float(lease_s)
        self._deadlines: dict[str, float] = {}
        self.completed = 0
        self.expired = 0
        self.aborted = 0
        self.renewed = 0
        self.late_notifications = 0

    def __len__(self) -> int:
        return len(self._deadlines)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._deadlines

    def deadline(self, request_id: str) -> float:
        """When the request's lease runs out (on the injected clock)."""
        try:
            return self._deadlines[request_id]
        except KeyError:
            raise InvalidArgumentError(f"request {request_id!r} is not pending") from None

    def add(self, request_id: str) -> float:
        """Put a request under lease; returns its deadline. A request id already pending is an
        ``InvalidArgumentError`` (nothing changes)."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidArgumentError(f"a request id is a non-empty str, got {request_id!r}")
        if request_id in self._deadlines:
            raise InvalidArgumentError(f"request {request_id!r} is already pending")
        deadline = self._clock() + self.lease_s
        self._deadlines[request_id] = deadline
        return deadline

    def renew(self, request_id: str) -> bool:
        """Extend the lease to ``now + lease_s`` (never shortens it); False if not pending."""
        if request_id not in self._deadlines:
            self.late_notifications += 1
            return False
        self._deadlines[request_id] = max(self._deadlines[request_id], self._clock() + self.lease_s)
        self.renewed += 1
        return True

    def complete(self, request_id: str) -> bool:
        """The decode side is done with the blocks: free them. False (and counted) if the
        request is not pending (already expired, or a repeated notification)."""
        if request_id not in self._deadlines:
            self.late_notifications += 1
            return False
        del self._deadlines[request_id]
        self.completed += 1
        self._free_request(request_id)
        return True

    def abort(self, request_id: str) -> bool:
        """The prefill engine drops the request: free it now. False if not pending."""
        if request_id not in self._deadlines:
            return False
        del self._deadlines[request_id]
        self.aborted += 1
        self._free_request(request_id)
        return True

    def expire(self) -> list[str]:
        """Free every request whose lease has run out; returns their ids, oldest deadline first.
        If ``free_request`` raises, the requests before it are freed, it is gone, and the rest
        stay pending for the next call."""
        now = self._clock()
        due = sorted((d, r) for r, d in self._deadlines.items() if d <= now)
        freed: list[str] = []
        for _, request_id in due:
            del self._deadlines[request_id]
            self.expired += 1
            freed.append(request_id)
            self._free_request(request_id)
        return freed

    def release_all(self) -> list[str]:
        """Free every pending request (shutdown); returns their ids."""
        freed = list(self._deadlines)
        for request_id in freed:
            self.abort(request_id)
        return freed
