"""``OffloadWorker``: store I/O off the step's critical path.

One background thread owns the store calls. Puts are queued (a bounded queue: when it is full
the put is dropped and counted, the step never waits for the disk or the network). Loads are
served before queued puts, key by key, and ``load(..., deadline_s)`` returns whatever is ready
by the deadline: a block not loaded in time is a miss (the caller recomputes it), and the
worker skips the rest of an abandoned load. Any exception a store raises is caught, counted
(``failures``, ``last_error``) and the worker keeps going: a broken store costs hits, never a
step.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedkv.errors import InvalidArgumentError, InvalidArgumentTypeError
from pagedkv.offload.codec import Payload, check_payload
from pagedkv.offload.keys import encode_key, hash_to_int
from pagedkv.offload.seconds import seconds
from pagedkv.offload.store import BlockStore

__all__ = ["LATENCY_EWMA_WEIGHT", "OffloadWorker", "Prefetch"]

# The weight of the newest get in ``OffloadWorker.get_latency_s``: about the last ten gets count.
LATENCY_EWMA_WEIGHT = 0.2


@dataclass
class _Load:
    hashes: list[int]
    extra_key: object
    kv_cache_dtype: str | None
    results: dict[int, Payload] = field(default_factory=dict)
    served: int = 0  # gets finished (answered or raised)
    abandoned: bool = False
    done: bool = False


class Prefetch:
    """A load queued by ``OffloadWorker.prefetch``; ``take`` it once."""

    def __init__(self, worker: OffloadWorker, request: _Load) -> None:
        self._worker = worker
        self._request = request

    @property
    def done(self) -> bool:
        with self._worker._cond:
            return self._request.done

    def take(self, wait_s: float) -> dict[int, Payload]:
        """The payloads loaded so far, after waiting at most ``wait_s`` seconds for the load to
        finish (keyed by the hash as an ``int``; a hash missing is a miss). The rest of the
        load is abandoned."""
        end = time.monotonic() + seconds("wait_s", wait_s)
        cond, request = self._worker._cond, self._request
        with cond:
            while not request.done:
                left = end - time.monotonic()
                if left <= 0:
                    break
                cond.wait(left)
            if not request.done:
                request.abandoned = True
                self._worker.late_loads += 1
            return dict(request.results)

    def wait(self, wait_s: float) -> int:
        """Wait at most ``wait_s`` seconds for the load to finish or its next get to finish;
        the number of its gets finished so far. Abandons nothing (``take`` still ends it)."""
        end = time.monotonic() + seconds("wait_s", wait_s)
        cond, request = self._worker._cond, self._request
        with cond:
            served = request.served
            while not request.done and request.served == served:
                left = end - time.monotonic()
                if left <= 0:
                    break
                cond.wait(left)
            return request.served

    @property
    def abandoned(self) -> bool:
        """``take`` ended the load before it finished (the deadline passed)."""
        with self._worker._cond:
            return self._request.abandoned


def _dtype_kw(kv_cache_dtype: str | None) -> dict[str, str]:
    """The dtype keyword of a store call, passed only when set: a store written before quantized
    caches (no such keyword) keeps serving unquantized blocks."""
    return {} if kv_cache_dtype is None else {"kv_cache_dtype": kv_cache_dtype}


class OffloadWorker:
    """Runs ``store``'s puts and gets on a background thread (see the module docs)."""

    def __init__(self, store: BlockStore, *, max_pending_puts: int = 64, name: str = "offload"):
        if not isinstance(store, BlockStore):
            raise InvalidArgumentTypeError(
                f"store is a pagedkv.offload BlockStore, not {type(store).__name__}"
            )
        if isinstance(max_pending_puts, bool) or not isinstance(max_pending_puts, int):
            raise InvalidArgumentTypeError("max_pending_puts is an int")
        if max_pending_puts < 1:
            raise InvalidArgumentError(f"max_pending_puts is positive, got {max_pending_puts}")
        self._store = store
        self._max_puts = max_pending_puts
        self._cond = threading.Condition()
        self._puts: collections.deque[tuple[int, Payload, object, bool, str | None]] = collections.deque()
        self._loads: collections.deque[_Load] = collections.deque()
        self._closing = False
        self._busy = False
        self.completed_puts = 0
        self.failed_puts = 0
        self.dropped_puts = 0
        self.skipped_puts = 0  # ``if_absent`` puts the store already held
        self.late_loads = 0
        # Seconds one ``get`` the store answered took (hit or miss; a raising get is not an
        # answer), an exponential moving average over the recent ones; None before the first.
        self.get_latency_s: float | None = None
        self.failures = 0
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"pagedkv-{name}", daemon=True)
        self._thread.start()

    @property
    def store(self) -> BlockStore:
        return self._store

    @property
    def pending_puts(self) -> int:
        with self._cond:
            return len(self._puts)

    def submit_put(
        self,
        block_hash: int | bytes,
        payload: Payload,
        *,
        extra_key: object = None,
        if_absent: bool = False,
        kv_cache_dtype: str | None = None,
    ) -> bool:
        """Queue a put; ``False`` if it was dropped (the queue is full, or the worker closed).
        The payload is not copied: the caller hands it over and does not mutate it. With
        ``if_absent`` the worker first asks the store (``contains``, on its own thread) and skips
        a key it holds (``skipped_puts``): a shared store another writer filled costs a lookup,
        not a rewrite. A wrong hash, salt, dtype or payload type raises here, on the caller's
        thread. ``kv_cache_dtype``: the cache's dtype, part of the key (None: unquantized)."""
        if not isinstance(if_absent, bool):
            raise InvalidArgumentTypeError(f"if_absent is a bool, not {type(if_absent).__name__}")
        value = hash_to_int(block_hash)
        encode_key(value, extra_key, kv_cache_dtype)  # validates the salt and the dtype
        check_payload(payload)
        with self._cond:
            if self._closing or len(self._puts) >= self._max_puts:
                self.dropped_puts += 1
                return False
            self._puts.append((value, payload, extra_key, if_absent, kv_cache_dtype))
            self._cond.notify()
        return True

    def load(
        self,
        block_hashes: Iterable[int | bytes],
        deadline_s: float,
        *,
        extra_key: object = None,
        kv_cache_dtype: str | None = None,
    ) -> dict[int, Payload]:
        """The payloads of ``block_hashes`` the store returned within ``deadline_s`` seconds
        (keyed by the hash as an ``int``); a hash missing from the result is a miss."""
        deadline = seconds("deadline_s", deadline_s)
        hashes = [hash_to_int(h) for h in block_hashes]
        encode_key(0, extra_key, kv_cache_dtype)  # validates the salt and the dtype
        request = _Load(hashes, extra_key, kv_cache_dtype)
        if not hashes:
            return {}
        end = time.monotonic() + deadline
        with self._cond:
            if self._closing:
                return {}
            self._loads.append(request)
            self._cond.notify_all()
            while not request.done:
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            if not request.done:
                request.abandoned = True
                self.late_loads += 1
            return dict(request.results)

    def prefetch(
        self,
        block_hashes: Iterable[int | bytes],
        *,
        extra_key: object = None,
        kv_cache_dtype: str | None = None,
    ) -> Prefetch:
        """Queue a load and return at once: ``Prefetch.take(wait_s)`` later returns what has
        arrived (waiting at most ``wait_s`` for the rest). Like ``load``, it goes before queued
        puts; a prefetch taken or dropped before it finishes stops where it is."""
        hashes = [hash_to_int(h) for h in block_hashes]
        encode_key(0, extra_key, kv_cache_dtype)  # validates the salt and the dtype
        request = _Load(hashes, extra_key, kv_cache_dtype)
        with self._cond:
            if self._closing or not hashes:
                request.done = True
            else:
                self._loads.append(request)
                self._cond.notify_all()
        return Prefetch(self, request)

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued put has run; ``False`` if ``timeout_s`` passed first."""
        end = time.monotonic() + seconds("timeout_s", timeout_s)
        with self._cond:
            while self._puts or self._busy:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float = 5.0, *, drain: bool = True) -> bool:
        """Stop the worker: run the queued puts first (``drain``) or drop them, waiting at most
        ``timeout_s``; puts still queued then are dropped. ``True`` if the thread stopped."""
        timeout = seconds("timeout_s", timeout_s)
        end = time.monotonic() + timeout
        if drain:
            self.flush(timeout)
        with self._cond:
            self._closing = True
            self.dropped_puts += len(self._puts)
            self._puts.clear()
            for request in self._loads:
                request.abandoned = True
            self._loads.clear()
            self._cond.notify_all()
        self._thread.join(max(0.0, end - time.monotonic()))
        return not self._thread.is_alive()

    def __enter__(self) -> OffloadWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the thread ----------------------------------------------------------------------

    def _note_latency(self, took_s: float) -> None:
        with self._cond:
            last = self.get_latency_s
            self.get_latency_s = took_s if last is None else last + LATENCY_EWMA_WEIGHT * (took_s - last)

    def _note_failure(self, exc: BaseException) -> None:
        with self._cond:
            self.failures += 1
            self.last_error = f"{type(exc).__name__}: {exc}"

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._closing or self._loads or self._puts):
                    self._cond.wait()
                if self._closing:
                    return
                request = self._loads.popleft() if self._loads else None
                put = None if request is not None else self._puts.popleft()
                self._busy = True
            try:
                if request is not None:
                    self._serve(request)
                elif put is not None:
                    self._put(*put)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _serve(self, request: _Load) -> None:
        for value in request.hashes:
            if request.abandoned:
                return
            start = time.monotonic()
            try:
                payload = self._store.get(
                    value, extra_key=request.extra_key, **_dtype_kw(request.kv_cache_dtype)
                )
            except Exception as exc:  # noqa: BLE001 - the worker outlives any store bug
                self._note_failure(exc)
                payload = None
            else:
                self._note_latency(time.monotonic() - start)
            with self._cond:
                request.served += 1
                if payload is not None:
                    request.results[value] = payload
                self._cond.notify_all()  # ``Prefetch.wait`` counts the gets as they finish
        with self._cond:
            request.done = True
            self._cond.notify_all()

    def _put(
        self, value: int, payload: Payload, extra_key: object, if_absent: bool, kv_cache_dtype: str | None
    ) -> None:
        dtype = _dtype_kw(kv_cache_dtype)
        try:
            if if_absent and self._store.contains(value, extra_key=extra_key, **dtype):
                with self._cond:
                    self.skipped_puts += 1
                return
            stored = self._store.put(value, payload, extra_key=extra_key, **dtype)
        except Exception as exc:  # noqa: BLE001 - the worker outlives any store bug
            self._note_failure(exc)
            stored = False
        with self._cond:
            if stored:
                self.completed_puts += 1
            else:
                self.failed_puts += 1
