"""Hardening: the ZMQ event publisher under hostile and unlucky use.

Each test failed on the publisher before the fix: a bad event killed its thread while ``publish``
kept returning True; 200 unanswered replay requests held up the live stream for seconds (every
pending replay was served in full before the next live batch); a subscriber that never reads
pinned up to 100,000 messages whatever their size; a ``close`` that timed out left the ports
bound. Loopback addresses only; every wait is bounded.
"""

from __future__ import annotations

import queue
import time
from typing import Any

import pagedkv
import pytest
from pagedkv.events import BlockRemoved, ZmqEventPublisher

zmq = pytest.importorskip("zmq")

LOOPBACK = "tcp://127.0.0.1:*"
HANG_GUARD_MS = 60_000  # only a guard against hanging; nothing asserts a duration
HANG_GUARD_S = HANG_GUARD_MS / 1000
SUBSCRIBER_BUFFER_BYTES = 64 << 20  # the publisher's default bound (pagedkv.events.zmq_publisher)


class Index:
    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __index__(self) -> int:
        raise self.error


def subscribe(pub: ZmqEventPublisher, **options: int) -> Any:
    """A SUB socket that has received at least one batch (past ZMQ's slow-joiner window), with
    everything sent so far read."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    for option, value in options.items():
        sub.setsockopt(getattr(zmq, option), value)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    deadline = time.monotonic() + HANG_GUARD_S
    while not sub.poll(20):
        assert time.monotonic() < deadline, "the subscriber never joined"
        pub.publish([])
    read_through(sub, pub)
    return sub


def read_through(sub: Any, pub: ZmqEventPublisher) -> None:
    """Reads every batch published so far (PUB keeps order: the last one comes last). Reading
    until a pause instead left batches unread when a busy machine delivered them after it."""
    assert pub.flush(HANG_GUARD_S)
    last = pub.published_batches - 1
    while next_seq(sub) < last:
        pass


def next_seq(sub: Any) -> int:
    assert sub.poll(HANG_GUARD_MS), "no live batch"
    return int.from_bytes(sub.recv_multipart()[1], "big")


@pytest.mark.parametrize("error", [ValueError("no such id"), SystemExit(3)])
def test_a_bad_event_raises_on_the_callers_thread_and_publishes_nothing(error: BaseException) -> None:
    with ZmqEventPublisher(LOOPBACK) as pub:
        sub = subscribe(pub)
        sent = pub.published_batches
        bad = BlockRemoved(block_hashes=[1, Index(error)])  # type: ignore[list-item]
        with pytest.raises(
            pagedkv.InvalidArgumentError if isinstance(error, Exception) else SystemExit
        ) as caught:
            pub.publish([bad])
        if isinstance(error, SystemExit):
            assert caught.value is error  # exit status 3 stays 3
        pub.publish([BlockRemoved(block_hashes=[2])])
        assert next_seq(sub) == sent  # the good batch, with the next sequence number
        assert pub.flush(HANG_GUARD_S) and pub.published_batches == sent + 1 and pub.failed_batches == 0
        sub.close(linger=0)


class FailingSends:
    """Wraps the publisher's PUB socket: its first ``failures`` sends raise ``error``."""

    def __init__(self, socket: Any, error: Exception, failures: int) -> None:
        self.socket, self.error, self.failures = socket, error, failures

    def send_multipart(self, *args: Any, **kwargs: Any) -> Any:
        if self.failures:
            self.failures -= 1
            raise self.error
        return self.socket.send_multipart(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.socket, name)


def test_the_thread_survives_a_failing_send_and_reports_it() -> None:
    with ZmqEventPublisher(LOOPBACK) as pub:
        sub = subscribe(pub)
        sent = pub.published_batches
        error = zmq.ZMQError(zmq.ENOTSOCK)
        pub._pub = FailingSends(pub._pub, error, failures=2)  # type: ignore[assignment]
        for _ in range(3):
            pub.publish([BlockRemoved(block_hashes=[7])])
        assert pub.flush(HANG_GUARD_S)
        assert pub.failed_batches == 2 and pub.last_error is error
        assert next_seq(sub) == sent  # the third batch went out: the thread is alive
        pub.publish([])
        assert next_seq(sub) == sent + 1
        sub.close(linger=0)


class MarkedQueue(queue.Queue[bytes]):
    """The publisher's queue, writing "queued" into ``log`` as a batch goes in, under the
    queue's lock, which the publisher's thread takes to get a batch: the mark is exactly
    ordered with the thread's sends."""

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log

    def _put(self, item: bytes) -> None:
        self.log.append("queued")
        super()._put(item)


class LoggedSends:
    """Wraps one of the publisher's sockets: writes ``name`` into ``log`` at each send."""

    def __init__(self, socket: Any, name: str, log: list[str]) -> None:
        self.socket, self.name, self.log = socket, name, log

    def send_multipart(self, *args: Any, **kwargs: Any) -> Any:
        self.log.append(self.name)
        return self.socket.send_multipart(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.socket, name)


def test_unanswered_replay_requests_do_not_hold_up_the_live_stream() -> None:
    """200 requesters that never read, each asking for all 10,000 buffered batches (2,000,000
    replay messages): the next live batch goes out after at most one replay message. Checked
    on the thread's own record of its sends, not by how many replay messages went out before
    the test looked (a busy machine can let the thread send any number meanwhile)."""
    buffered, requesters = 10_000, 200
    with ZmqEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, buffer_steps=buffered) as pub:
        sub = subscribe(pub)
        for _ in range(buffered):
            pub.publish([])
        read_through(sub, pub)
        context = zmq.Context.instance()
        dealers = [context.socket(zmq.DEALER) for _ in range(requesters)]
        for dealer in dealers:
            dealer.connect(pub.replay_endpoint)
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        # A reader of its own replay: its first answer says the publisher is serving replays.
        reader = context.socket(zmq.DEALER)
        reader.connect(pub.replay_endpoint)
        reader.send_multipart([b"", (0).to_bytes(8, "big")])
        assert reader.poll(HANG_GUARD_MS), "no replay answer"
        log: list[str] = []
        pub._queue = MarkedQueue(log)  # empty, as the old one is: every batch was sent
        pub._pub = LoggedSends(pub._pub, "live", log)  # type: ignore[assignment]
        pub._replay = LoggedSends(pub._replay, "replay", log)  # type: ignore[assignment]
        live = pub.published_batches
        pub.publish([BlockRemoved(block_hashes=[9])])
        assert next_seq(sub) == live
        sent = log[log.index("queued") :]
        assert sent.index("live") <= 2, sent[:5]  # "queued", at most one "replay", "live"
        pub._pub, pub._replay = pub._pub.socket, pub._replay.socket  # type: ignore[union-attr]
        for socket in [*dealers, reader]:
            socket.close(linger=0)
        sub.close(linger=0)


class FakeManager:
    """Hands out one precomputed payload per ``take_event_batch`` (what ``drain`` sends)."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload

    def take_event_batch(self, ts: float, rank: int | None) -> tuple[int, bytes]:
        return 1, self.payload


def test_a_subscriber_that_never_reads_pins_a_bounded_number_of_bytes() -> None:
    """40 batches of 4 MiB (160 MiB) to a subscriber that reads nothing: under the default 64 MiB
    bound the publisher keeps at most 15 of them for it (its SUB and the kernel's socket buffers
    hold one or two more); before, ZMQ's message-count HWM (100,000) kept every one."""
    payload_bytes, batches = 4 << 20, 40
    with ZmqEventPublisher(LOOPBACK) as pub:
        sub = subscribe(pub, RCVHWM=1, RCVBUF=64 << 10)
        kv = FakeManager(b"\x00" * payload_bytes)
        for _ in range(batches):
            pub.drain(kv)
        assert pub.flush(timeout_s=HANG_GUARD_S)
        kept = SUBSCRIBER_BUFFER_BYTES // (payload_bytes + 8)
        received = 0
        # The first batch within the guard; then until a pause (a late batch only lowers the count).
        while sub.poll(500 if received else HANG_GUARD_MS):
            sub.recv_multipart()
            received += 1
        assert 0 < received <= kept + 4, received
        assert pub.published_batches >= batches  # PUB drops for the slow peer, not the sender
        sub.close(linger=0)


def test_the_byte_bound_sets_the_high_water_mark_from_the_largest_message() -> None:
    with ZmqEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, subscriber_buffer_bytes=1 << 20) as pub:
        assert pub._pub is not None and pub._replay is not None
        for size, hwm in ((1000, (1 << 20) // 1008), (64 << 10, (1 << 20) // ((64 << 10) + 8)), (100, 15)):
            pub.drain(FakeManager(b"\x00" * size))
            assert pub.flush(HANG_GUARD_S)
            assert (
                pub._pub.getsockopt(zmq.SNDHWM) == hwm and pub._replay.getsockopt(zmq.SNDHWM) == hwm
            )  # never raised again
        pub.drain(FakeManager(b"\x00" * (2 << 20)))  # larger than the whole bound: one message
        assert pub.flush(HANG_GUARD_S) and pub._pub.getsockopt(zmq.SNDHWM) == 1


def port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def bind_again(endpoint: str) -> None:
    """Binds a fresh socket to ``endpoint`` at once (no retry: ``close`` waited for ZMQ's I/O
    thread to close the listener)."""
    socket = zmq.Context.instance().socket(zmq.PUB)
    try:
        socket.bind(endpoint)
        socket.unbind(socket.getsockopt_string(zmq.LAST_ENDPOINT))  # inproc: released at once
    finally:
        socket.close(linger=0)


def test_close_that_times_out_releases_the_ports() -> None:
    """The thread is still busy (a replay flood and a queue of batches) when ``close(0)`` gives
    up waiting; the ports must be free when it returns."""
    pub = ZmqEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, buffer_steps=5000)
    endpoints = [pub.endpoint, pub.replay_endpoint]
    for _ in range(5000):
        pub.publish([])
    assert pub.flush(timeout_s=HANG_GUARD_S)
    context = zmq.Context.instance()
    dealers = [context.socket(zmq.DEALER) for _ in range(50)]
    for dealer in dealers:
        assert pub.replay_endpoint is not None
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    assert dealers[0].poll(HANG_GUARD_MS)  # the thread is serving the flood
    for _ in range(2000):
        pub.publish([])
    pub.close(timeout_s=0.0)
    for endpoint in endpoints:
        assert endpoint is not None
        bind_again(f"tcp://127.0.0.1:{port(endpoint)}")
    assert pub.published_batches + pub.dropped_batches == 7000  # each sent or counted
    for dealer in dealers:
        dealer.close(linger=0)


@pytest.mark.parametrize("kind", ["tcp", "ipc", "inproc"])
def test_close_releases_every_bound_endpoint_at_once(kind: str, tmp_path: Any) -> None:
    """Twenty close-and-rebind rounds each: before, ZMQ's asynchronous listener shutdown left
    the address in use for a moment (9 of 50 immediate rebinds failed on loopback TCP)."""
    for round_ in range(20):
        if kind == "tcp":
            endpoint = LOOPBACK
        elif kind == "ipc":
            endpoint = f"ipc://{tmp_path}/events-{round_}"
        else:
            endpoint = "inproc://pagedkv-events-rebind"
        pub = ZmqEventPublisher(endpoint)
        pub.publish([])
        pub.close()
        bind_again(pub.endpoint)
