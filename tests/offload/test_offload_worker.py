"""OffloadWorker: puts off the caller's thread, loads with a deadline (late is a miss, never a
stall), and a worker that outlives any store failure.

No test asserts a wall-clock time: a slow store is one blocked on an event that the test
releases only after ``load`` has returned, so a ``load`` that waited for the store would
never return (the event's own 30 s timeout turns that bug into a failure, not a hang)."""

from __future__ import annotations

import threading
from collections.abc import Iterable

import numpy as np
import pytest

pytest.importorskip("xxhash", reason="pagedkv.offload needs the offload extra (xxhash)")

import pagedkv.offload.worker as worker_module  # noqa: E402
from pagedkv.errors import InvalidArgumentError, InvalidArgumentTypeError  # noqa: E402
from pagedkv.offload import DiskStore, OffloadWorker  # noqa: E402
from pagedkv.offload.codec import Payload  # noqa: E402

STUCK_S = 30.0


class ScriptedStore:
    """A dict-backed store whose gets of ``slow`` hashes block until ``release`` is set, and
    which raises ``RuntimeError`` for ``broken`` hashes."""

    def __init__(self, slow: Iterable[int] = (), broken: Iterable[int] = ()):
        self.data: dict[tuple[int, object], Payload] = {}
        self.slow = set(slow)
        self.broken = set(broken)
        self.release = threading.Event()
        self.entered = threading.Event()
        self.calls: list[tuple[str, int]] = []

    def put(self, block_hash, payload, *, extra_key=None) -> bool:
        self.calls.append(("put", block_hash))
        if block_hash in self.broken:
            raise RuntimeError(f"disk on fire at {block_hash}")
        if block_hash in self.slow:
            self.entered.set()
            self.release.wait(STUCK_S)
        self.data[(block_hash, extra_key)] = payload
        return True

    def get(self, block_hash, *, extra_key=None):
        self.calls.append(("get", block_hash))
        if block_hash in self.broken:
            raise RuntimeError(f"disk on fire at {block_hash}")
        if block_hash in self.slow:
            self.entered.set()
            self.release.wait(STUCK_S)
        return self.data.get((block_hash, extra_key))

    def contains(self, block_hash, *, extra_key=None) -> bool:
        return (block_hash, extra_key) in self.data

    def contains_many(self, block_hashes, *, extra_key=None) -> list[bool]:
        return [self.contains(h, extra_key=extra_key) for h in block_hashes]

    def delete(self, block_hash, *, extra_key=None) -> bool:
        return self.data.pop((block_hash, extra_key), None) is not None

    capacity_bytes = None
    usage_bytes = 0
    stats = None


def test_puts_run_in_the_background_and_loads_return_them(tmp_path):
    with OffloadWorker(DiskStore(tmp_path, 1 << 24)) as worker:
        block = np.arange(2 * 16 * 3 * 64, dtype=np.float32).reshape(2, 16, 3, 64)
        assert worker.submit_put(1, block, extra_key=b"t")
        assert worker.submit_put((2).to_bytes(16, "little"), b"two")
        assert worker.flush(STUCK_S)
        got = worker.load([1, 2, 3], deadline_s=STUCK_S, extra_key=b"t")
        assert set(got) == {1}
        np.testing.assert_array_equal(got[1], block)
        assert worker.load([2, 3], deadline_s=STUCK_S) == {2: b"two"}
        assert worker.completed_puts == 2 and worker.failures == 0


class StuckStoreClock:
    """The worker module's clock (its ``time``): still until the store is stuck, then past every
    deadline. A load's deadline then passes exactly when the store is stuck, whatever the
    machine's load: with the real clock, a busy machine could let 50 ms pass before the worker
    fetched even the first key, and the load came back empty."""

    def __init__(self, stuck: threading.Event) -> None:
        self.stuck = stuck

    def monotonic(self) -> float:
        return 1e6 if self.stuck.is_set() else 0.0


def test_a_load_not_ready_by_its_deadline_is_a_miss_not_a_stall(monkeypatch):
    store = ScriptedStore(slow=[2])
    store.data = {(1, None): b"one", (2, None): b"two", (3, None): b"three"}
    worker = OffloadWorker(store)
    monkeypatch.setattr(worker_module, "time", StuckStoreClock(store.entered))
    try:
        got = worker.load([1, 2, 3], deadline_s=0.05)
        released = store.release.is_set()
        assert not released  # the store was still stuck when load returned
        assert got == {1: b"one"}  # what was ready in time; 2 and 3 are misses
        assert worker.late_loads == 1
    finally:
        store.release.set()
        monkeypatch.undo()
    # The abandoned load stops at the slow key: 3 is never fetched for it.
    assert worker.flush(STUCK_S)
    assert worker.load([3], deadline_s=STUCK_S) == {3: b"three"}
    assert store.calls.count(("get", 3)) == 1
    assert worker.close(STUCK_S)


def test_the_worker_survives_store_exceptions():
    store = ScriptedStore(broken=[13])
    store.data[(1, None)] = b"one"
    with OffloadWorker(store) as worker:
        assert worker.submit_put(13, b"x")
        assert worker.submit_put(14, b"y")
        assert worker.flush(STUCK_S)
        assert worker.load([13, 1], deadline_s=STUCK_S) == {1: b"one"}
        assert worker.failures == 2 and "disk on fire at 13" in (worker.last_error or "")
        assert worker.failed_puts == 1 and worker.completed_puts == 1
        assert worker.load([14], deadline_s=STUCK_S) == {14: b"y"}


def test_a_full_queue_drops_puts_instead_of_blocking():
    store = ScriptedStore(slow=[0])
    worker = OffloadWorker(store, max_pending_puts=2)
    try:
        assert worker.submit_put(0, b"blocks the worker")
        assert store.entered.wait(STUCK_S)
        assert worker.submit_put(1, b"a") and worker.submit_put(2, b"b")
        assert not worker.submit_put(3, b"c")
        assert worker.dropped_puts == 1 and worker.pending_puts == 2
    finally:
        store.release.set()
    assert worker.close(STUCK_S)
    assert set(store.data) == {(0, None), (1, None), (2, None)}


def test_a_put_if_absent_skips_what_the_store_holds():
    """Another writer (a replica on a shared store) stored key 1 first: the worker asks the
    store and does not rewrite it; an absent key (or another salt's) is written."""
    store = ScriptedStore()
    store.data[(1, b"t")] = b"theirs"
    with OffloadWorker(store) as worker:
        assert worker.submit_put(1, b"mine", extra_key=b"t", if_absent=True)
        assert worker.submit_put(2, b"mine", extra_key=b"t", if_absent=True)
        assert worker.submit_put(1, b"forced", extra_key=b"u", if_absent=True)  # another salt
        assert worker.flush(STUCK_S)
        assert store.data[(1, b"t")] == b"theirs" and store.data[(2, b"t")] == b"mine"
        assert store.data[(1, b"u")] == b"forced"
        assert ("put", 1) in store.calls and store.calls.count(("put", 1)) == 1
        assert worker.skipped_puts == 1 and worker.completed_puts == 2
        assert worker.submit_put(1, b"again", extra_key=b"t")  # without if_absent: rewritten
        assert worker.flush(STUCK_S)
        assert store.data[(1, b"t")] == b"again" and worker.skipped_puts == 1


def test_loads_go_before_queued_puts():
    store = ScriptedStore(slow=[0])
    store.data[(9, None)] = b"nine"
    worker = OffloadWorker(store)
    assert worker.submit_put(0, b"slow")
    assert store.entered.wait(STUCK_S)
    for h in (1, 2, 3):
        worker.submit_put(h, b"queued")
    result: dict[int, bytes] = {}
    loader = threading.Thread(target=lambda: result.update(worker.load([9], STUCK_S)))
    loader.start()
    while not worker._loads:  # the load is queued behind the running put
        threading.Event().wait(0.001)
    store.release.set()
    loader.join(STUCK_S)
    assert result == {9: b"nine"}
    assert store.calls.index(("get", 9)) < store.calls.index(("put", 1))
    assert worker.close(STUCK_S)


def test_close_drains_or_drops_within_its_timeout():
    store = ScriptedStore()
    worker = OffloadWorker(store)
    for h in range(5):
        worker.submit_put(h, b"x")
    assert worker.close(STUCK_S, drain=True)
    assert len(store.data) == 5
    assert not worker.submit_put(9, b"late") and worker.load([1], STUCK_S) == {}

    stuck = ScriptedStore(slow=[0])
    worker = OffloadWorker(stuck)
    worker.submit_put(0, b"x")
    assert stuck.entered.wait(STUCK_S)
    worker.submit_put(1, b"never runs")
    try:
        assert worker.close(0.01, drain=False) is False  # the thread is stuck in the store
        assert worker.dropped_puts == 1
    finally:
        stuck.release.set()
    worker._thread.join(STUCK_S)
    assert not worker._thread.is_alive() and (1, None) not in stuck.data


def test_caller_mistakes_are_typed_errors():
    with pytest.raises(InvalidArgumentTypeError):
        OffloadWorker(object())  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        OffloadWorker(ScriptedStore(), max_pending_puts=0)
    with OffloadWorker(ScriptedStore()) as worker:
        with pytest.raises(InvalidArgumentTypeError):
            worker.load([1], deadline_s="soon")  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError):
            worker.load([1], deadline_s=-1.0)
        with pytest.raises(InvalidArgumentError):
            worker.load([1], deadline_s=float("nan"))
        with pytest.raises(InvalidArgumentTypeError):
            worker.submit_put("key", b"x")  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentTypeError):
            worker.load(["key"], deadline_s=1.0)  # type: ignore[list-item]
        with pytest.raises(InvalidArgumentError):
            worker.load([1], deadline_s=float("inf"))
        with pytest.raises(InvalidArgumentTypeError):
            worker.submit_put(1, "text")  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentTypeError):
            worker.submit_put(1, np.array([object()]))
        with pytest.raises(InvalidArgumentTypeError):
            worker.submit_put(1, b"x", extra_key=7)
        with pytest.raises(InvalidArgumentTypeError):
            worker.load([1], deadline_s=1.0, extra_key=[1])
        with pytest.raises(InvalidArgumentTypeError):
            worker.submit_put(1, b"x", if_absent=1)  # type: ignore[arg-type]
        assert worker.load([], deadline_s=0) == {}
        assert worker.pending_puts == 0 and worker.failures == 0


def test_a_prefetch_loads_while_the_caller_does_other_work():
    store = ScriptedStore(slow=[2])
    store.data = {(1, None): b"one", (2, None): b"two", (3, None): b"three"}
    worker = OffloadWorker(store)
    try:
        pending = worker.prefetch([1, 2, 3])  # returns at once: key 2 is stuck
        assert not pending.done
        # Key 1 has arrived once the worker is stuck on key 2 (waiting for that, not for a
        # duration: a busy machine may take longer than take's 50 ms to get there).
        assert store.entered.wait(STUCK_S)
        assert pending.take(0.05) == {1: b"one"}  # what arrived; the rest is abandoned
        assert worker.late_loads == 1
    finally:
        store.release.set()
    assert worker.flush(STUCK_S)
    assert store.calls.count(("get", 3)) == 0  # abandoned before key 3
    ready = worker.prefetch([3, 1])
    assert ready.take(STUCK_S) == {3: b"three", 1: b"one"}
    assert worker.prefetch([]).take(0.0) == {}
    with pytest.raises(InvalidArgumentTypeError):
        worker.prefetch([1.5])  # type: ignore[list-item]
    with pytest.raises(InvalidArgumentError):
        ready.take(float("nan"))
    assert worker.close(STUCK_S)
    assert worker.prefetch([1]).take(0.0) == {}  # closed: an empty result, no error
