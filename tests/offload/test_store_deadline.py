"""The store look-up's deadline (``EngineConfig.offload_deadline_s``, engine/store_lookup.py):
a fixed one cuts a slow store's load short, and counts it; the adaptive default (None) follows
the store's measured seconds per get, so the same slow store serves every block; a store that
answers nothing is waited for once, then no more."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

pytest.importorskip("xxhash", reason="pagedkv.offload needs the offload extra (xxhash)")

from pagedkv.engine import store_lookup  # noqa: E402
from pagedkv.engine.store_lookup import StoreLookup  # noqa: E402
from pagedkv.offload import DiskStore, OffloadWorker  # noqa: E402

SHAPE = (2, 2, 4, 1, 8)
SALT = b"test"


class _SlowGets(DiskStore):
    """Each get takes ``delay_s`` longer (a remote store on a busy machine)."""

    delay_s = 0.02

    def get(self, block_hash, *, extra_key=None):
        time.sleep(self.delay_s)
        return super().get(block_hash, extra_key=extra_key)


class _HungGets(DiskStore):
    """Gets that hang until ``release`` is set (a network that stopped answering)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.release = threading.Event()

    def get(self, block_hash, *, extra_key=None):
        self.release.wait(30.0)
        return None


def _filled(store: DiskStore, n: int) -> list[int]:
    rng = np.random.default_rng(0)
    hashes = list(range(1, n + 1))
    for h in hashes:
        assert store.put(h, rng.standard_normal(SHAPE).astype(np.float32), extra_key=SALT)
    return hashes


def _lookup(store, deadline_s):
    return StoreLookup(OffloadWorker(store), SALT, SHAPE, block_size=4, deadline_s=deadline_s)


def test_a_fixed_deadline_cuts_a_slow_store_short_and_counts_it(tmp_path):
    store = _SlowGets(tmp_path / "kv", capacity_bytes=1 << 20)
    hashes = _filled(store, 12)  # 12 x 20 ms: far past 50 ms
    lookup = _lookup(store, deadline_s=0.05)
    try:
        found = lookup.lookup(hashes)
        assert len(found) < len(hashes)
        assert lookup.deadline_misses == 1
    finally:
        lookup.worker.close(5.0)


def test_the_adaptive_deadline_waits_for_a_slow_store_at_its_own_pace(tmp_path):
    store = _SlowGets(tmp_path / "kv", capacity_bytes=1 << 20)
    hashes = _filled(store, 12)
    lookup = _lookup(store, deadline_s=None)
    try:
        assert lookup.deadline_for(12) is None  # nothing measured yet: the first get measures
        assert [h for h, _ in lookup.lookup(hashes)] == hashes
        latency = lookup.worker.get_latency_s
        assert latency is not None and latency >= store.delay_s
        # The next look-up's deadline follows the measurement, within the bounds.
        expected = 12 * store_lookup.LATENCY_MARGIN * latency
        assert lookup.deadline_for(12) == pytest.approx(min(store_lookup.MAX_DEADLINE_S, expected))
        assert lookup.deadline_for(1) >= store_lookup.MIN_DEADLINE_S
        assert [h for h, _ in lookup.lookup(hashes)] == hashes
        assert lookup.deadline_misses == 0
    finally:
        lookup.worker.close(5.0)


def test_a_store_that_answers_nothing_is_waited_for_once(tmp_path, monkeypatch):
    monkeypatch.setattr(store_lookup, "MAX_DEADLINE_S", 0.3)
    store = _HungGets(tmp_path / "kv", capacity_bytes=1 << 20)
    lookup = _lookup(store, deadline_s=None)
    try:
        start = time.monotonic()
        assert lookup.lookup([1, 2, 3]) == []
        first = time.monotonic() - start
        assert first >= 0.3  # the one wait for a first measurement
        assert lookup.deadline_for(3) == store_lookup.MIN_DEADLINE_S
        start = time.monotonic()
        assert lookup.lookup([4, 5, 6]) == []
        assert time.monotonic() - start < 0.3
        assert lookup.deadline_misses == 2
    finally:
        store.release.set()
        lookup.worker.close(5.0)
