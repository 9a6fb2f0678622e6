"""Publishes KV events over ZMQ exactly as vLLM does, so KV-aware routers can subscribe unchanged.

Wire protocol (vLLM's ``ZmqEventPublisher``, docs/events.md):

* a PUB socket sends each batch as three frames: the topic (bytes; llm-d expects
  ``kv@<pod>@<model>``), the batch's sequence number as 8 bytes big-endian (0, 1, 2, ...), and
  the payload ``pagedkv.events.encode_batch`` writes;
* an optional ROUTER socket (``replay_endpoint``) serves the last ``buffer_steps`` batches: a
  request ``[identity, b"", start_seq]`` (8 bytes big-endian) is answered with one
  ``[identity, b"", seq, payload]`` per buffered batch whose ``seq >= start_seq``, then the end
  marker ``[identity, b"", seq = -1 (8 bytes, signed), b""]``. Every batch ``publish`` queued
  before the request arrived is in the answer, also one the thread had not sent yet.

``publish`` encodes on the caller's thread (a bad event raises a typed pagedkv error there and
nothing is queued), then hands the payload to a bounded queue without blocking. One background
thread sends, buffers and serves replays, and it alone touches the sockets. When the queue is full
the batch is dropped and counted in ``dropped_batches`` (the subscriber sees no sequence gap for it,
so a consumer that must be exact should size ``max_queue_batches`` for its bursts; the default holds
100,000 batches).

Bounds (docs/events.md):

* replays never hold up the live stream: a replay answer is sent one buffered batch at a time, and
  between two live batches the thread sends at most one replay message, so a live batch waits for
  at most one replay message however many replay requests are pending (at most
  ``MAX_PENDING_REPLAYS`` are read off the socket at a time; the rest wait in ZMQ's queue);
* a subscriber that never reads pins at most ``subscriber_buffer_bytes`` plus one message in the
  publisher: ZMQ's high-water mark counts messages, so before a message larger than any sent
  before, the send high-water mark of both sockets is lowered to
  ``subscriber_buffer_bytes // largest_message_bytes`` (ZMQ applies it to connected peers too);
  messages over it are dropped for that subscriber, as any PUB drops for a slow one;
* the thread survives every failure: a send that raises is counted in ``failed_batches`` and kept
  in ``last_error``;
* ``close(timeout_s)`` sends what is queued until ``timeout_s`` passes, then drops the rest (counted
  in ``dropped_batches``); the thread unbinds every bound endpoint, waits until ZMQ has closed
  its listener, and closes the sockets before ``close`` returns, so the addresses can be bound
  again at once, also when it timed out.

Endpoints follow vLLM's rule: an address with ``*`` or ``::`` or an ``ipc://`` / ``inproc://``
address is bound, any other is connected to. ``tcp://127.0.0.1:*`` binds a free port;
``.endpoint`` / ``.replay_endpoint`` say which.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import zmq

from pagedkv.errors import ClosedError, InvalidArgumentError, InvalidArgumentTypeError
from pagedkv.events.wire import encode_batch

KvEvent = Any
"""A ``pagedkv.events`` event object (typed loosely here: the package ``pagedkv.events`` imports
this module)."""

__all__ = ["ZmqEventPublisher", "END_SEQ", "MAX_PENDING_REPLAYS", "SUBSCRIBER_BUFFER_BYTES"]

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame that ends a replay answer."""

MAX_PENDING_REPLAYS = 1024
"""Replay requests being answered at once (round robin, ~100 bytes each); later ones wait in the
ROUTER socket's queue (its receive high-water mark)."""

SUBSCRIBER_BUFFER_BYTES = 64 << 20
"""Default bound on what one subscriber that never reads pins in the publisher (64 MiB)."""

_POLL_S = 0.01
"""How long the idle publisher thread waits for a batch before checking for replay requests."""

_SEQ_BYTES = 8

_RELEASE_WAIT_MS = 1000
"""How long closing waits for ZMQ's I/O thread to close a listening socket."""

_MAX_HWM = 2**31 - 1
"""ZMQ's high-water marks are C ints."""


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _release(socket: zmq.Socket[Any], bound: str | None) -> None:
    """Closes ``socket``; when it was bound to ``bound`` (its resolved address), unbinds it first
    and, for TCP and IPC, waits (at most _RELEASE_WAIT_MS) until the listener is closed. ZMQ closes
    listeners on its I/O thread: without the wait a bind right after ``close`` can still find the
    address in use (9 of 50 immediate rebinds failed on loopback; 0 of 50 with it)."""
    try:
        if bound is not None:
            monitor = None
            if not bound.startswith("inproc://"):
                monitor = socket.get_monitor_socket(zmq.EVENT_CLOSED)
            try:
                socket.unbind(bound)
                if monitor is not None and monitor.poll(_RELEASE_WAIT_MS):
                    monitor.recv_multipart(zmq.NOBLOCK)
            finally:
                if monitor is not None:
                    socket.disable_monitor()
                    monitor.close(linger=0)
    except zmq.ZMQError:
        pass  # nothing left to release: closing below is all there is to do
    finally:
        socket.close(linger=0)


def _open(context: zmq.Context[Any], kind: int, endpoint: str, send_hwm: int) -> zmq.Socket[Any]:
    socket = context.socket(kind)
    try:
        socket.setsockopt(zmq.SNDHWM, send_hwm)  # (a ROUTER's receive side keeps ZMQ's default)
        if _binds(endpoint):
            socket.bind(endpoint)
        else:
            socket.connect(endpoint)
    except BaseException:
        socket.close(linger=0)
        raise
    return socket


def _seconds(timeout_s: Any) -> float:
    """A timeout in seconds, clamped to [0, 1e9]; anything else is an InvalidArgumentError."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s != timeout_s:
        raise InvalidArgumentError(f"timeout_s must be a number of seconds, got {timeout_s!r}")
    return float(min(max(timeout_s, 0), 10**9))


@dataclass
class _Replay:
    """One replay answer in progress: send batches ``next_seq .. end_seq - 1`` (those still
    buffered) to ``identity``, then the end marker."""

    identity: bytes
    next_seq: int
    end_seq: int


class ZmqEventPublisher:
    """vLLM-compatible KV-event publisher: PUB (3 frames per batch) plus a ROUTER replay socket.

    ``with ZmqEventPublisher("tcp://*:5557", topic="kv@pod-0@model") as pub: pub.publish(events)``.
    ``drain(kv)`` publishes whatever ``kv.take_events()`` returns (nothing when it is empty).
    Bad arguments raise ``InvalidArgumentError`` (``InvalidArgumentTypeError`` for a wrong type),
    and so does an endpoint ZMQ cannot bind or connect.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        topic: str = "",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10000,
        data_parallel_rank: int = 0,
        hwm: int = 100_000,
        max_queue_batches: int = 100_000,
        subscriber_buffer_bytes: int = SUBSCRIBER_BUFFER_BYTES,
    ) -> None:
        if not isinstance(endpoint, str) or not endpoint:
            raise InvalidArgumentError("endpoint must be a non-empty ZMQ address string")
        if replay_endpoint is not None and (not isinstance(replay_endpoint, str) or not replay_endpoint):
            raise InvalidArgumentError("replay_endpoint must be a non-empty ZMQ address string or None")
        if not isinstance(topic, str):
            raise InvalidArgumentTypeError(f"topic must be a str, not {type(topic).__name__}")
        for name, value, least in (
            ("buffer_steps", buffer_steps, 1),
            ("hwm", hwm, 0),
            ("max_queue_batches", max_queue_batches, 1),
            ("data_parallel_rank", data_parallel_rank, 0),
            ("subscriber_buffer_bytes", subscriber_buffer_bytes, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise InvalidArgumentError(f"{name} must be an int >= {least}, got {value!r}")
        # ZMQ's options are C ints; data_parallel_rank goes out as a 64-bit int.
        for name, value, most in (
            ("hwm", hwm, _MAX_HWM),
            ("data_parallel_rank", data_parallel_rank, 2**63 - 1),
        ):
            if value > most:
                raise InvalidArgumentError(f"{name} must be <= {most}, got {value}")
        try:
            self._topic = str.encode(topic, "utf-8")
        except UnicodeEncodeError as error:
            raise InvalidArgumentError(f"topic is not valid UTF-8 ({error.reason})") from None
        self._data_parallel_rank = data_parallel_rank
        self._hwm_cap = hwm  # 0: no count bound, only the byte bound
        self._subscriber_buffer_bytes = subscriber_buffer_bytes
        self._largest_message_bytes = 0
        # Encoded payloads (`publish` encodes on the caller's thread).
        self._queue: queue.Queue[bytes] = queue.Queue(max_queue_batches)
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._replays: collections.deque[_Replay] = collections.deque()
        self._context: zmq.Context[Any] = zmq.Context.instance()
        self._pub: zmq.Socket[Any] | None = None
        self._replay: zmq.Socket[Any] | None = None
        self._pub_bound: str | None = None  # the resolved address, for a socket that bound
        self._replay_bound: str | None = None
        try:
            self._pub = _open(self._context, zmq.PUB, endpoint, self._hwm(0))
            self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
            self._pub_bound = self.endpoint if _binds(endpoint) else None
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = _open(self._context, zmq.ROUTER, replay_endpoint, self._hwm(0))
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) or replay_endpoint
                self._replay_bound = self.replay_endpoint if _binds(replay_endpoint) else None
        except (zmq.ZMQError, ValueError) as error:  # ValueError: UnicodeEncodeError of an address
            self._close_sockets()
            raise InvalidArgumentError(f"ZMQ refused the endpoint: {error}") from error
        except BaseException:
            self._close_sockets()
            raise
        self.dropped_batches = 0
        """Batches dropped: ``publish`` found the queue full, or ``close`` timed out before them."""
        self.published_batches = 0
        """Batches sent on the PUB socket (the next sequence number)."""
        self.failed_batches = 0
        """Batches (or replay messages) whose send raised (``last_error`` says why); the thread
        goes on with the next."""
        self.last_error: Exception | None = None
        """The last failure the publisher thread survived, or None."""
        self.replayed_batches = 0
        """Buffered batches sent as replay answers."""
        self._lock = threading.Lock()
        self._closed = False
        self._stop = threading.Event()
        self._stop_deadline = 0.0
        self._thread = threading.Thread(target=self._run, name="pagedkv-zmq-publisher", daemon=True)
        self._thread.start()

    def _hwm(self, message_bytes: int) -> int:
        """The send high-water mark (messages) that keeps a non-reading subscriber under the byte
        bound when no message is larger than ``message_bytes``."""
        by_bytes = min(max(1, self._subscriber_buffer_bytes // max(1, message_bytes)), _MAX_HWM)
        return by_bytes if self._hwm_cap == 0 else min(self._hwm_cap, by_bytes)

    # -- the caller's side: never blocks ----------------------------------------------------------
    def publish(self, events: Iterable[KvEvent]) -> bool:
        """Encodes ``events`` as one batch (stamped now) and queues it; returns False when the
        queue was full and the batch was dropped. A bad event raises the typed error
        ``pagedkv.events.encode_batch`` raises, and nothing is queued. Raises RuntimeError after
        ``close()``."""
        with self._lock:
            if self._closed:
                raise ClosedError("ZmqEventPublisher is closed")
        return self._enqueue(encode_batch(events, time.time(), self._data_parallel_rank))

    def _enqueue(self, payload: bytes) -> bool:
        """Queues an encoded payload; False when the queue was full."""
        with self._lock:
            if self._closed:
                raise ClosedError("ZmqEventPublisher is closed")
            try:
                self._queue.put_nowait(payload)
            except queue.Full:
                self.dropped_batches += 1
                return False
        return True

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Waits until every queued batch has been sent (or failed); False on timeout."""
        deadline = time.monotonic() + _seconds(timeout_s)
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._queue.all_tasks_done.wait(remaining)
        return True

    def drain(self, kv: Any) -> int:
        """Publishes ``kv.take_events()`` as one batch when there are any; returns how many.

        A ``pagedkv.KvCacheManager`` drains and encodes them in one call (``take_event_batch``:
        the same bytes, without building an event object per event:
        benches/results/2026-12-02-prefix-admission.md, "Follow-up: events, eviction, the
        benchmark itself"); any other object with a ``take_events()`` goes through ``publish``."""
        take_batch = getattr(kv, "take_event_batch", None)
        if take_batch is None:
            events = kv.take_events()
            if events:
                self.publish(events)
            return len(events)
        with self._lock:
            if self._closed:  # checked before draining: closed, the events stay in `kv`
                raise ClosedError("ZmqEventPublisher is closed")
        count, payload = take_batch(time.time(), self._data_parallel_rank)
        if count:
            self._enqueue(payload)
        return int(count)

    def close(self, timeout_s: float = 5.0) -> None:
        """Sends what is queued (up to ``timeout_s``; the rest is dropped and counted), stops the
        thread and closes the sockets: when it returns, the endpoints are released. Idempotent."""
        wait_s = _seconds(timeout_s)
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop_deadline = time.monotonic() + wait_s
        self._stop.set()
        # Each step of the thread is one non-blocking send, so it sees the stop promptly.
        self._thread.join()

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # -- the publisher thread: the only user of the sockets ----------------------------------------
    def _run(self) -> None:
        try:
            while True:
                try:
                    if not self._step():
                        return
                except Exception as error:  # a bug or a ZMQ failure: count it, keep serving
                    self.failed_batches += 1
                    self.last_error = error
        finally:
            self._drop_queued()
            self._close_sockets()

    def _step(self) -> bool:
        """One live batch (when queued) and at most one replay message; False when stopping."""
        if self._stop.is_set():
            if time.monotonic() > self._stop_deadline:
                return False
            try:
                payload = self._queue.get_nowait()
            except queue.Empty:
                return False
            self._send_live(payload)
            return True
        self._accept_replays()
        try:
            # Wait for a batch only when no replay work is pending.
            payload = self._queue.get_nowait() if self._replays else self._queue.get(timeout=_POLL_S)
        except queue.Empty:
            pass
        else:
            self._send_live(payload)
        self._serve_one_replay()
        return True

    def _send_live(self, payload: bytes) -> None:
        try:
            assert self._pub is not None
            seq = self.published_batches
            self._bound_memory(len(self._topic) + _SEQ_BYTES + len(payload))
            self._pub.send_multipart((self._topic, seq.to_bytes(_SEQ_BYTES, "big"), payload), zmq.NOBLOCK)
            self._buffer.append((seq, payload))
            self.published_batches = seq + 1
        except zmq.Again:  # PUB drops for a slow peer instead; counted for any other socket
            self.failed_batches += 1
        except Exception as error:
            self.failed_batches += 1
            self.last_error = error
        finally:
            self._queue.task_done()

    def _bound_memory(self, message_bytes: int) -> None:
        """Lowers both sockets' send high-water mark before a message larger than any before."""
        if message_bytes <= self._largest_message_bytes:
            return
        self._largest_message_bytes = message_bytes
        hwm = self._hwm(message_bytes)
        for socket in (self._pub, self._replay):
            if socket is not None and socket.getsockopt(zmq.SNDHWM) != hwm:
                socket.setsockopt(zmq.SNDHWM, hwm)  # ZMQ >= 4.2 applies it to connected peers too

    def _drop_queued(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return
            self.dropped_batches += 1
            self._queue.task_done()

    def _close_sockets(self) -> None:
        for socket, bound in ((self._pub, self._pub_bound), (self._replay, self._replay_bound)):
            if socket is not None:
                _release(socket, bound)

    # -- replays ------------------------------------------------------------------------------------
    def _accept_replays(self) -> None:
        """Reads replay requests while fewer than MAX_PENDING_REPLAYS are being answered."""
        replay = self._replay
        if replay is None:
            return
        while len(self._replays) < MAX_PENDING_REPLAYS and replay.poll(0):
            frames = replay.recv_multipart(zmq.NOBLOCK)
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != _SEQ_BYTES:
                # Malformed request: answer nothing but the end marker when we know who asked.
                if frames:
                    replay.send_multipart((frames[0], b"", END_SEQ, b""), zmq.NOBLOCK)
                continue
            start_seq = int.from_bytes(frames[2], "big", signed=True)
            # The answer covers every batch published before the request was read: those sent,
            # and those still queued (``publish`` returned, so they are in the queue; they get
            # their sequence numbers as they are sent, ahead of this answer's end). A batch
            # published meanwhile may be in it too; a reader that is also subscribed gets it
            # live as well and keeps one copy by its sequence number.
            end_seq = self.published_batches + self._queue.qsize()
            self._replays.append(_Replay(frames[0], start_seq, end_seq))

    def _serve_one_replay(self) -> None:
        """Sends the next message of the oldest pending answer (round robin among them)."""
        if not self._replays or self._replay is None:
            return
        job = self._replays.popleft()
        published = self.published_batches
        if job.end_seq > published and self._queue.empty():
            # Batches counted at the request that never got a number: their sends failed.
            job.end_seq = published
        oldest = self._buffer[0][0] if self._buffer else published
        job.next_seq = max(job.next_seq, oldest)  # batches evicted meanwhile are gone
        if job.next_seq >= job.end_seq:
            self._replay.send_multipart((job.identity, b"", END_SEQ, b""), zmq.NOBLOCK)
            return
        if job.next_seq >= published:  # its next batch is still queued: the live send goes first
            self._replays.append(job)
            return
        seq, payload = self._buffer[job.next_seq - oldest]
        self._replay.send_multipart(
            (job.identity, b"", seq.to_bytes(_SEQ_BYTES, "big"), payload), zmq.NOBLOCK
        )
        self.replayed_batches += 1
        job.next_seq += 1
        self._replays.append(job)
