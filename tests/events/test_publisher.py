"""pagedkv.events.ZmqEventPublisher against a subscriber written the way vLLM documents its
protocol: SUB socket over 127.0.0.1, three frames per batch, contiguous sequence numbers, and a
gap after a subscriber restart recovered through the ROUTER replay socket."""

from __future__ import annotations

import random
from typing import Any

import pagedkv
import pytest
from pagedkv.events import BlockStored, ZmqEventPublisher

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgspec")
from vllm_kv_events_schema import DECODER, Batch  # noqa: E402

TOPIC = "kv@pod-0@tiny-model"
TIMEOUT_MS = 60_000  # only a guard against hanging: every wait ends when its message arrives
TIMEOUT_S = TIMEOUT_MS / 1000


class Subscriber:
    """A router's side: SUB for live batches, DEALER for replays."""

    def __init__(self, pub: ZmqEventPublisher, topic: str = TOPIC) -> None:
        self.context = zmq.Context.instance()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, 0)  # a test reads in bursts: never drop on our side
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sub.connect(pub.endpoint)
        self.pub = pub
        self.topic = topic.encode()

    def recv(self) -> tuple[int, Batch]:
        assert self.sub.poll(TIMEOUT_MS), "no batch within the timeout"
        topic, seq, payload = self.sub.recv_multipart()
        assert topic == self.topic and len(seq) == 8
        return int.from_bytes(seq, "big"), DECODER.decode(payload)

    def join(self) -> int:
        """Waits out ZMQ's slow-joiner window: publishes empty batches until one arrives, then
        reads the rest of them; returns the sequence number of the last."""
        while True:
            self.pub.publish([])
            if self.sub.poll(50):
                seq = self.recv()[0]
                break
        assert self.pub.flush(TIMEOUT_S)  # every batch join queued has been sent
        last = self.pub.published_batches - 1
        while seq < last:  # PUB keeps order: everything after the first received arrives
            seq = self.recv()[0]
        return seq

    def replay(self, start_seq: int) -> list[tuple[int, Batch]]:
        assert self.pub.replay_endpoint is not None
        dealer = self.context.socket(zmq.DEALER)
        dealer.connect(self.pub.replay_endpoint)
        try:
            dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
            got = []
            while True:
                assert dealer.poll(TIMEOUT_MS), "replay answer timed out"
                empty, seq, payload = dealer.recv_multipart()
                assert empty == b""
                number = int.from_bytes(seq, "big", signed=True)
                if number == -1:
                    assert payload == b""
                    return got
                got.append((number, DECODER.decode(payload)))
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        self.sub.close(linger=0)


def engine_steps(seed: int, steps: int):  # type: ignore[no-untyped-def]
    """Yields a KvCacheManager after each admission of a random prompt with shared prefixes."""
    rng = random.Random(seed)
    kv = pagedkv.KvCacheManager(
        num_blocks=32, block_size=4, enable_prefix_caching=True, enable_kv_events=True
    )
    prefixes = [[rng.randrange(1000) for _ in range(8)] for _ in range(4)]
    for seq in range(steps):
        kv.add_sequence(seq, rng.choice(prefixes) + [rng.randrange(1000) for _ in range(6)])
        kv.free(seq)
        yield kv


def test_burst_arrives_complete_and_in_order() -> None:
    with ZmqEventPublisher("tcp://127.0.0.1:*", topic=TOPIC, replay_endpoint="tcp://127.0.0.1:*") as pub:
        sub = Subscriber(pub)
        first = sub.join()
        sent_events = []
        for kv in engine_steps(0, 2000):  # a burst: nothing reads until all are queued
            events = kv.take_events()
            sent_events.append(events)
            assert pub.publish(events)
        received = [sub.recv() for _ in range(len(sent_events))]
        seqs = [seq for seq, _ in received]
        assert seqs == list(range(first + 1, first + 1 + len(sent_events)))  # nothing missed
        for events, (_, batch) in zip(sent_events, received, strict=True):
            assert batch.data_parallel_rank == 0
            assert [type(e).__name__ for e in batch.events] == [
                {"BlockStored": "Stored", "BlockRemoved": "Removed", "AllBlocksCleared": "Cleared"}[
                    type(e).__name__
                ]
                for e in events
            ]
            for ours, theirs in zip(events, batch.events, strict=True):
                assert theirs.block_hashes == [h & ((1 << 64) - 1) for h in ours.block_hashes]
        sub.close()
        assert pub.dropped_batches == 0 and pub.failed_batches == 0


class ObjectsOnly:
    """A manager seen only through ``take_events`` (what ``drain`` accepts from other engines)."""

    def __init__(self, kv: pagedkv.KvCacheManager) -> None:
        self.kv = kv

    def take_events(self) -> list[object]:
        return self.kv.take_events()


def test_drain_sends_what_take_events_would() -> None:
    # A pagedkv manager is drained straight to bytes (take_event_batch), any other object
    # through take_events and publish: twin engines give the same events either way.
    with ZmqEventPublisher("tcp://127.0.0.1:*", topic=TOPIC, data_parallel_rank=2) as pub:
        sub = Subscriber(pub)
        sub.join()
        fast, slow = engine_steps(5, 60), engine_steps(5, 60)
        counts = []
        for kv, twin in zip(fast, slow, strict=True):
            counts.append(pub.drain(kv))
            assert pub.drain(ObjectsOnly(twin)) == counts[-1]
        assert pub.drain(kv) == 0  # nothing left: nothing sent
        batches = [sub.recv()[1] for _ in range(2 * sum(c > 0 for c in counts))]
        for direct, via_objects in zip(batches[::2], batches[1::2], strict=True):
            assert direct.data_parallel_rank == via_objects.data_parallel_rank == 2
            assert direct.events == via_objects.events and direct.events
        assert sum(len(b.events) for b in batches[::2]) == sum(counts)
        assert not sub.sub.poll(100)
        sub.close()
    with pytest.raises(RuntimeError, match="closed"):
        pub.drain(kv)


def test_restarted_subscriber_recovers_the_gap_by_replay() -> None:
    with ZmqEventPublisher("tcp://127.0.0.1:*", topic=TOPIC, replay_endpoint="tcp://127.0.0.1:*") as pub:
        sub = Subscriber(pub)
        last_seen = sub.join()
        steps = engine_steps(1, 300)
        for _ in range(100):
            pub.drain(next(steps))
        for _ in range(100):
            last_seen = sub.recv()[0]
        sub.close()  # the router restarts; the engine keeps publishing
        for _ in range(150):
            pub.drain(next(steps))
        assert pub.flush(TIMEOUT_S)
        sub = Subscriber(pub)
        live_from = sub.join()
        assert live_from > last_seen + 1  # the restarted subscriber sees a gap...
        replayed = sub.replay(last_seen + 1)  # ...and fills it from the replay buffer
        replayed_seqs = [s for s, _ in replayed]
        assert replayed_seqs == list(range(last_seen + 1, replayed_seqs[-1] + 1))
        assert replayed_seqs[-1] >= live_from  # replay overlaps the live stream: no hole left
        assert sum(len(b.events) for _, b in replayed) > 0
        sub.close()


def test_replay_buffer_is_bounded() -> None:
    endpoint = f"ipc:///tmp/pagedkv-test-pub-{random.getrandbits(32)}"
    with ZmqEventPublisher(endpoint, replay_endpoint="tcp://127.0.0.1:*", buffer_steps=5) as pub:
        for _ in range(12):
            pub.publish([BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1], block_size=1)])
        assert pub.flush(TIMEOUT_S) and pub.published_batches == 12
        sub = Subscriber(pub, topic="")
        assert [s for s, _ in sub.replay(0)] == [7, 8, 9, 10, 11]
        assert [s for s, _ in sub.replay(10)] == [10, 11]
        assert sub.replay(99) == []
        sub.close()


def test_malformed_replay_request_gets_the_end_marker_and_the_publisher_keeps_going() -> None:
    with ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*") as pub:
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart([b"", b"short"])
        assert dealer.poll(TIMEOUT_MS)
        assert dealer.recv_multipart() == [b"", (-1).to_bytes(8, "big", signed=True), b""]
        dealer.close(linger=0)
        pub.publish([])
        sub = Subscriber(pub, topic="")
        assert [s for s, _ in sub.replay(0)][:1] == [0]
        sub.close()


class HeldPublisher(ZmqEventPublisher):
    """Sends no live batch until its thread has read a replay request, so every batch published
    before the request is still queued when the request is read: the schedule a busy machine
    produced now and then (the malformed-request test above failed under load), made certain."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.holding = True  # read by the thread that super().__init__ starts
        super().__init__(*args, **kwargs)

    def _step(self) -> bool:
        if not self.holding or self._stop.is_set():
            return super()._step()
        assert self._replay is not None
        self._replay.poll(10)  # the thread's own socket: waits for a request, not a duration
        self._accept_replays()
        self.holding = not self._replays
        return True


class FailingFirstSend:
    """The publisher's PUB socket, whose first send raises (the batch gets no sequence number)."""

    def __init__(self, socket: Any) -> None:
        self.socket, self.failed = socket, False

    def send_multipart(self, *args: Any, **kwargs: Any) -> Any:
        if not self.failed:
            self.failed = True
            raise zmq.ZMQError(zmq.ENOTSOCK)
        return self.socket.send_multipart(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.socket, name)


def test_a_replay_includes_every_batch_published_before_the_request() -> None:
    with HeldPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*") as pub:
        for _ in range(3):
            pub.publish([])
        sub = Subscriber(pub, topic="")
        # Queued, not yet sent when the request was read: they are sent live, then replayed.
        assert [s for s, _ in sub.replay(0)] == [0, 1, 2]
        assert [s for s, _ in sub.replay(1)] == [1, 2]
        assert pub.flush(TIMEOUT_S) and pub.published_batches == 3
        sub.close()


def test_a_replay_counting_a_batch_whose_send_failed_still_ends() -> None:
    with HeldPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*") as pub:
        pub._pub = FailingFirstSend(pub._pub)  # type: ignore[assignment]
        pub.publish([])  # its send fails: no sequence number
        pub.publish([])  # sequence number 0
        sub = Subscriber(pub, topic="")
        assert [s for s, _ in sub.replay(0)] == [0]  # and the end marker, not a wait for seq 1
        assert pub.failed_batches == 1 and pub.published_batches == 1
        sub.close()


def test_lifecycle_and_argument_checks() -> None:
    pub = ZmqEventPublisher("tcp://127.0.0.1:*")
    assert pub.replay_endpoint is None
    pub.publish([])
    for timeout in ("1", float("nan"), None, True):
        with pytest.raises(pagedkv.InvalidArgumentError, match="timeout_s"):
            pub.flush(timeout)  # type: ignore[arg-type]
        with pytest.raises(pagedkv.InvalidArgumentError, match="timeout_s"):
            pub.close(timeout)  # type: ignore[arg-type]
    assert pub.flush(10**400)
    pub.close(10**400)
    pub.close()  # idempotent
    with pytest.raises(RuntimeError):
        pub.publish([])
    for kwargs in (
        {"buffer_steps": 0},
        {"max_queue_batches": 0},
        {"hwm": -1},
        {"hwm": 1 << 40},  # ZMQ's options are C ints: was an OverflowError
        {"data_parallel_rank": True},
        {"subscriber_buffer_bytes": 0},
        {"topic": "kv@\ud800"},  # a lone surrogate: was a UnicodeEncodeError
    ):
        with pytest.raises(pagedkv.InvalidArgumentError):
            ZmqEventPublisher("tcp://127.0.0.1:*", **kwargs)  # type: ignore[arg-type]
    with pytest.raises(pagedkv.InvalidArgumentError):
        ZmqEventPublisher("")
    with pytest.raises(pagedkv.InvalidArgumentError) as caught:
        ZmqEventPublisher("tcp://127.0.0.1:*", topic=b"kv")  # type: ignore[arg-type]
    assert isinstance(caught.value, TypeError)  # as before
    # ZMQErrors, and UnicodeEncodeErrors for the lone surrogates, before.
    for endpoint in ("nonsense://x", "tcp://nonsense", "tcp://*:nonsense", "tcp://\ud800:*", "inproc://\x00"):
        with pytest.raises(pagedkv.InvalidArgumentError, match="endpoint"):
            ZmqEventPublisher(endpoint)
    for replay in ("nonsense://x", "tcp://\ud800:*"):
        with pytest.raises(pagedkv.InvalidArgumentError, match="endpoint"):
            ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint=replay)
    # A byte budget whose high-water mark would overflow ZMQ's C int (an OverflowError before).
    ZmqEventPublisher("tcp://127.0.0.1:*", hwm=0, subscriber_buffer_bytes=1 << 40).close()


def test_bad_events_raise_on_the_callers_thread() -> None:
    with ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*") as pub:
        with pytest.raises(pagedkv.InvalidArgumentError, match=r"events\[0\]"):
            pub.publish([object()])  # type: ignore[list-item]
        pub.publish([])
        assert pub.flush(TIMEOUT_S)
        assert pub.failed_batches == 0 and pub.last_error is None
        assert pub.published_batches == 1


def test_full_queue_drops_and_counts() -> None:
    with ZmqEventPublisher("tcp://127.0.0.1:*", max_queue_batches=1) as pub:
        accepted = sum(pub.publish([]) for _ in range(2000))
        assert accepted + pub.dropped_batches == 2000
