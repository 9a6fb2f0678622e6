"""Managers on one shared BlockPool reclaim each other's cached blocks (docs/design.md, Shared
pools): one manager's prefix cache can never starve another."""

from __future__ import annotations

import random
import threading

import pagedkv
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

BS = 4


def _cached(kv: pagedkv.KvCacheManager) -> int:
    return int(kv.stats()["num_cached_blocks"])


def test_a_peers_cached_blocks_serve_another_manager() -> None:
    """Issue scenario: A caches 16 blocks and frees its sequence; B then admits 16 blocks."""
    pool = pagedkv.BlockPool(num_blocks=16, block_size=BS)
    a = pagedkv.KvCacheManager(pool=pool, enable_prefix_caching=True, enable_kv_events=True)
    b = pagedkv.KvCacheManager(pool=pool, enable_prefix_caching=True)
    a.add_sequence(1, list(range(16 * BS)))
    a.free(1)
    a.take_events()
    assert _cached(a) == 16 and pool.num_free_blocks == 0
    b.add_sequence(1, list(range(1000, 1000 + 16 * BS)))
    assert _cached(a) == 0
    removed = [e for e in a.take_events() if isinstance(e, pagedkv.BlockRemoved)]
    assert len(removed) == 16  # one per reclaimed block, in A's own event stream
    for kv in (a, b):
        kv.check_invariants()
    pool.check_invariants()


def test_only_the_shortfall_is_reclaimed_least_recent_first() -> None:
    pool = pagedkv.BlockPool(num_blocks=8, block_size=BS)
    a = pagedkv.KvCacheManager(pool=pool, enable_prefix_caching=True)
    b = pagedkv.KvCacheManager(pool=pool)  # a manager without prefix caching gains too
    a.add_sequence(1, list(range(4 * BS)))
    a.add_sequence(2, list(range(100, 100 + 4 * BS)))
    a.free(1)
    a.free(2)
    b.add_sequence(1, num_tokens=2 * BS)
    assert _cached(a) == 6
    # A's least recently used blocks went: sequence 1's, tail first; sequence 2 still hits.
    assert a.add_sequence(3, list(range(100, 100 + 4 * BS)) + [1]) == 4 * BS
    a.free(3)
    # Sequence 3's fresh block evicted A's next least recent block (sequence 1's second one).
    assert a.add_sequence(4, list(range(4 * BS)) + [1]) == 1 * BS


def test_a_shortfall_peers_cannot_cover_fails_and_leaves_them_alone() -> None:
    pool = pagedkv.BlockPool(num_blocks=8, block_size=BS)
    a = pagedkv.KvCacheManager(pool=pool, enable_prefix_caching=True)
    b = pagedkv.KvCacheManager(pool=pool)
    a.add_sequence(1, list(range(4 * BS)))
    a.free(1)
    b.add_sequence(1, num_tokens=3 * BS)
    stats_before = a.stats()
    try:
        b.add_sequence(2, num_tokens=6 * BS)  # 1 free + 4 cached < 6
    except pagedkv.OutOfBlocksError:
        pass
    else:
        raise AssertionError("admission should have failed")
    assert a.stats() == stats_before
    b.add_sequence(2, num_tokens=5 * BS)  # exactly what the pool can give
    assert _cached(a) == 0


class SharedPoolMachine(RuleBasedStateMachine):
    """Random admissions, appends and frees on three managers sharing one pool (two with
    prefix caching). After every step every manager's invariants hold, and a device shortage
    is reported only when the blocks truly do not exist anywhere on the pool."""

    NUM_BLOCKS = 24
    # The first manager makes the pool (no ``pool=``) and the others join it through
    # ``kv.pool``, instead of all three built on a ``BlockPool``.
    OWN_POOL = False

    def __init__(self) -> None:
        super().__init__()
        if self.OWN_POOL:
            first = pagedkv.KvCacheManager(
                num_blocks=self.NUM_BLOCKS, block_size=BS, enable_prefix_caching=True, enable_kv_events=True
            )
            self.pool = first.pool
        else:
            self.pool = pagedkv.BlockPool(num_blocks=self.NUM_BLOCKS, block_size=BS)
            first = pagedkv.KvCacheManager(pool=self.pool, enable_prefix_caching=True, enable_kv_events=True)
        self.kvs = [
            first,
            pagedkv.KvCacheManager(pool=self.pool, enable_prefix_caching=True),
            pagedkv.KvCacheManager(pool=self.pool),
        ]
        self.live: list[set[int]] = [set(), set(), set()]
        self.next_id = 0

    def _supply(self) -> int:
        return self.pool.num_free_blocks + sum(_cached(kv) for kv in self.kvs)

    @rule(
        which=st.integers(0, 2),
        prefix=st.integers(0, 3),
        length=st.integers(1, 12 * BS),
    )
    def add(self, which: int, prefix: int, length: int) -> None:
        kv = self.kvs[which]
        prompt = [prefix * 10_000 + i for i in range(length)]
        supply = self._supply()
        try:
            kv.add_sequence(self.next_id, prompt)
        except pagedkv.OutOfBlocksError:
            # Refused only when even every free and cached block of the pool would not do
            # (its own hits may be cached blocks it reuses rather than needs fresh).
            assert -(-length // BS) > supply
            return
        self.live[which].add(self.next_id)
        self.next_id += 1

    @rule(which=st.integers(0, 2), data=st.data())
    def free(self, which: int, data: st.DataObject) -> None:
        if self.live[which]:
            seq_id = data.draw(st.sampled_from(sorted(self.live[which])))
            self.kvs[which].free(seq_id)
            self.live[which].remove(seq_id)

    @rule(which=st.integers(0, 2), data=st.data(), n=st.integers(1, 2 * BS))
    def append(self, which: int, data: st.DataObject, n: int) -> None:
        if self.live[which]:
            seq_id = data.draw(st.sampled_from(sorted(self.live[which])))
            try:
                self.kvs[which].append_tokens(seq_id, [7] * n)
            except pagedkv.OutOfBlocksError:
                assert self._supply() < -(-n // BS) + 1  # at most one more for copy-on-write

    @invariant()
    def invariants_hold(self) -> None:
        for kv in self.kvs:
            kv.check_invariants()
        self.pool.check_invariants()
        in_use = sum(int(kv.stats()["num_blocks_in_use"]) for kv in self.kvs)
        assert in_use + sum(_cached(kv) for kv in self.kvs) + self.pool.num_free_blocks == self.NUM_BLOCKS


SharedPoolMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


class OwnPoolSharedMachine(SharedPoolMachine):
    OWN_POOL = True


OwnPoolSharedMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestSharedPoolMachine = SharedPoolMachine.TestCase
TestOwnPoolSharedMachine = OwnPoolSharedMachine.TestCase


def test_threads_reclaim_each_others_cached_blocks() -> None:
    """Four managers on four threads, each caching prompts that fill the pool on its own; every
    admission eventually succeeds (a shortage is retried), and at the end every block is back."""
    num_blocks = 64
    pool = pagedkv.BlockPool(num_blocks=num_blocks, block_size=BS)
    kvs = [pagedkv.KvCacheManager(pool=pool, enable_prefix_caching=True) for _ in range(4)]
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        rng = random.Random(i)
        kv = kvs[i]
        try:
            for step in range(150):
                prompt = [
                    i * 1_000_000 + rng.randrange(8) * 1000 + j for j in range(rng.randrange(1, 12 * BS))
                ]
                for _attempt in range(10_000):
                    try:
                        kv.add_sequence(step, prompt)
                        break
                    except pagedkv.OutOfBlocksError:
                        continue  # the others hold the blocks in use right now
                else:
                    raise AssertionError("admission never succeeded")
                kv.free(step)
                kv.check_invariants()
        except BaseException as error:  # noqa: BLE001 -- reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for kv in kvs:
        kv.check_invariants()
        assert kv.stats()["num_blocks_in_use"] == 0
    assert pool.num_free_blocks + sum(_cached(kv) for kv in kvs) == num_blocks
    assert sum(int(kv.stats()["evictions"]) for kv in kvs) > 0
    pool.check_invariants()


def test_a_managers_own_pool_shared_later_reclaims_both_ways() -> None:
    """A manager built without ``pool=`` makes its pool; one built later on ``kv.pool`` shares it,
    and each reclaims the other's cached blocks (the first manager is a peer of its own pool)."""
    first = pagedkv.KvCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    first.add_sequence(1, list(range(8 * BS)))
    first.free(1)
    second = pagedkv.KvCacheManager(pool=first.pool, enable_prefix_caching=True)
    second.add_sequence(1, list(range(1000, 1000 + 8 * BS)))  # every block, all of them first's
    assert _cached(first) == 0
    second.free(1)
    assert _cached(second) == 8
    first.add_sequence(2, list(range(2000, 2000 + 5 * BS)))  # and back
    assert _cached(second) == 3
    for kv in (first, second):
        kv.check_invariants()
    first.pool.check_invariants()
