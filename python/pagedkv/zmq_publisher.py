"""Publishes KV events over ZMQ exactly as vLLM does, so KV-aware routers can subscribe unchanged.

Wire protocol (vLLM's ``ZmqEventPublisher``, docs/events.md):

* a PUB socket sends each batch as three frames: the topic (bytes; llm-d expects
  ``kv@<pod>@<model>``), the batch's sequence number as 8 bytes big-endian (0, 1, 2, ...), and
  the payload ``pagedkv.events.encode_batch`` writes;
* an optional ROUTER socket (``replay_endpoint``) serves the last ``buffer_steps`` batches: a
  request ``[identity, b"", start_seq]`` (8 bytes big-endian) is answered with one
  ``[identity, b"", seq, payload]`` per buffered batch whose ``seq >= start_seq``, then the end
  marker ``[identity, b"", seq = -1 (8 bytes, signed), b""]``.

The payload is ``pagedkv.events.encode_batch``'s. ``publish`` never blocks the caller (the
allocator's hot path): it stamps the batch and hands it to a bounded queue; one background thread
encodes, sends, buffers and serves replays, and it alone touches the sockets. When the queue is full
the batch is dropped and counted in ``dropped_batches`` (the subscriber sees no sequence gap for it,
so a consumer that must be exact should size ``max_queue_batches`` for its bursts; the default holds
100,000 batches).

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
from types import TracebackType
from typing import Any

import zmq

# The encoder itself, not pagedkv.events (which re-exports this class: no import cycle).
from pagedkv._core import encode_event_batch

KvEvent = Any
"""A ``pagedkv.events`` event object (typed loosely here: pagedkv.events imports this module)."""

__all__ = ["ZmqEventPublisher", "END_SEQ"]

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame that ends a replay answer."""

_POLL_S = 0.01
"""How long the publisher thread waits for a batch before checking for replay requests."""


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _open(context: zmq.Context[Any], kind: int, endpoint: str, hwm: int | None) -> zmq.Socket[Any]:
    socket = context.socket(kind)
    try:
        if hwm is not None:
            socket.set_hwm(hwm)
        if _binds(endpoint):
            socket.bind(endpoint)
        else:
            socket.connect(endpoint)
    except BaseException:
        socket.close(linger=0)
        raise
    return socket


class ZmqEventPublisher:
    """vLLM-compatible KV-event publisher: PUB (3 frames per batch) plus a ROUTER replay socket.

    ``with ZmqEventPublisher("tcp://*:5557", topic="kv@pod-0@model") as pub: pub.publish(events)``.
    ``drain(kv)`` publishes whatever ``kv.take_events()`` returns (nothing when it is empty).
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
    ) -> None:
        if not isinstance(endpoint, str) or not endpoint:
            raise ValueError("endpoint must be a non-empty ZMQ address string")
        if replay_endpoint is not None and (not isinstance(replay_endpoint, str) or not replay_endpoint):
            raise ValueError("replay_endpoint must be a non-empty ZMQ address string or None")
        if not isinstance(topic, str):
            raise TypeError(f"topic must be a str, not {type(topic).__name__}")
        for name, value, least in (
            ("buffer_steps", buffer_steps, 1),
            ("hwm", hwm, 0),
            ("max_queue_batches", max_queue_batches, 1),
            ("data_parallel_rank", data_parallel_rank, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        self._topic = topic.encode("utf-8")
        self._data_parallel_rank = data_parallel_rank
        # A batch to encode (`publish`), an encoded payload (`drain`), or the stop sentinel.
        self._queue: queue.Queue[tuple[float, list[KvEvent]] | bytes | None] = queue.Queue(max_queue_batches)
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._context: zmq.Context[Any] = zmq.Context.instance()
        self._pub = _open(self._context, zmq.PUB, endpoint, hwm)
        self._replay: zmq.Socket[Any] | None = None
        try:
            if replay_endpoint is not None:
                self._replay = _open(self._context, zmq.ROUTER, replay_endpoint, None)
        except BaseException:
            self._pub.close(linger=0)
            raise
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
        self.replay_endpoint: str | None = (
            None if self._replay is None else self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        )
        self.dropped_batches = 0
        """Batches ``publish`` dropped because the queue was full."""
        self.published_batches = 0
        """Batches sent on the PUB socket (the next sequence number)."""
        self.failed_batches = 0
        """Batches not sent because ``encode_batch`` refused them (``last_error`` says why)."""
        self.last_error: Exception | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="pagedkv-zmq-publisher", daemon=True)
        self._thread.start()

    # -- the caller's side: never blocks ----------------------------------------------------------
    def publish(self, events: Iterable[KvEvent]) -> bool:
        """Queues ``events`` as one batch (stamped now); returns False when the queue was full and
        the batch was dropped. Raises RuntimeError after ``close()``."""
        return self._enqueue((time.time(), list(events)))

    def _enqueue(self, batch: tuple[float, list[KvEvent]] | bytes) -> bool:
        """Queues a batch to encode or an encoded payload; False when the queue was full."""
        with self._lock:
            if self._closed:
                raise RuntimeError("ZmqEventPublisher is closed")
            try:
                self._queue.put_nowait(batch)
            except queue.Full:
                self.dropped_batches += 1
                return False
        return True

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Waits until every queued batch has been sent (or refused); False on timeout."""
        deadline = time.monotonic() + timeout_s
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
        the same bytes, without building an event object per event, ~2 us each); any other
        object with a ``take_events()`` goes through ``publish``."""
        take_batch = getattr(kv, "take_event_batch", None)
        if take_batch is None:
            events = kv.take_events()
            if events:
                self.publish(events)
            return len(events)
        with self._lock:
            if self._closed:  # checked before draining: closed, the events stay in `kv`
                raise RuntimeError("ZmqEventPublisher is closed")
        count, payload = take_batch(time.time(), self._data_parallel_rank)
        if count:
            self._enqueue(payload)
        return int(count)

    def close(self, timeout_s: float = 5.0) -> None:
        """Sends what is queued (up to ``timeout_s``), stops the thread and closes the sockets.
        Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        # A sentinel after every queued batch: the thread sends them all, then stops.
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._queue.put(None, timeout=0.05)
                break
            except queue.Full:
                if time.monotonic() > deadline:
                    break
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():  # stuck past the timeout: let it see the flag and exit
            self._thread.join(1.0)
        if not self._thread.is_alive():
            self._pub.close(linger=1000)
            if self._replay is not None:
                self._replay.close(linger=0)

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
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if item is None:
                self._queue.task_done()
                return
            try:
                if isinstance(item, bytes):
                    self._send_payload(item)
                else:
                    self._send(*item)
            finally:
                self._queue.task_done()

    def _send(self, ts: float, events: list[KvEvent]) -> None:
        try:
            payload = encode_event_batch(events, ts, self._data_parallel_rank, False)
        except (TypeError, ValueError, OverflowError) as error:  # not pagedkv.events objects
            self.failed_batches += 1
            self.last_error = error
            return
        self._send_payload(payload)

    def _send_payload(self, payload: bytes) -> None:
        seq = self.published_batches
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self.published_batches = seq + 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            # Malformed request: answer nothing but the end marker when we know who asked.
            if frames:
                self._replay.send_multipart((frames[0], b"", END_SEQ, b""))
            return
        identity, _, start = frames
        start_seq = int.from_bytes(start, "big", signed=True)
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", END_SEQ, b""))
