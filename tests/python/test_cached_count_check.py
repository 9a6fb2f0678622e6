"""The pool's cached-block count is checked exactly from Python (docs/pool.md, Checks): a
manager's `check_invariants` compares it with its own cache while it is the pool's only manager
(the Python `BlockPool` object always holds the pool too, and an embedder's own blocks never
count), and on a shared pool `check_invariants` of a manager or of the pool compares it with
the sum of every manager's cache, each locked in turn."""

from __future__ import annotations

import threading

import pagedkv

BS = 2


def _prompt(family: int, num_blocks: int) -> list[int]:
    return [family * 10_000 + t for t in range(num_blocks * BS)]


def _churn(kv: pagedkv.KvCacheManager, round_: int, check: object) -> None:
    """Admits two prompts of one family (the second revives the first's cached blocks, several
    at once), one of another, frees each into the cache, then a fresh family that evicts."""
    assert callable(check)
    base = round_ * 10
    for i, family in enumerate((0, 0, 1)):
        kv.add_sequence(base + i, _prompt(round_ % 3 + family, 4))
        check()
        kv.free(base + i)
        check()
    kv.add_sequence(base + 9, _prompt(100 + round_, 6))
    check()
    kv.free(base + 9)
    check()


def test_a_lone_manager_checks_the_exact_count_beside_an_embedders_blocks() -> None:
    kv = pagedkv.KvCacheManager(num_blocks=12, block_size=BS, enable_prefix_caching=True)
    mine = kv.pool.allocate(1)
    for round_ in range(6):
        _churn(kv, round_, kv.check_invariants)
    stats = kv.stats()
    assert stats["num_cached_blocks"] > 0 and stats["blocks_evicted"] > 0
    assert kv.pool.release(mine[0])
    kv.check_invariants()


def test_a_shared_pool_checks_the_sum_of_its_managers_caches() -> None:
    pool = pagedkv.BlockPool(num_blocks=16, block_size=BS)
    kvs = [pagedkv.KvCacheManager(pool=pool, enable_prefix_caching=True) for _ in range(2)]

    def check() -> None:
        for kv in kvs:
            kv.check_invariants()
        pool.check_invariants()

    for round_ in range(6):
        # Each round needs most of the pool: the other manager's cache gives it back on a
        # shortage (the reclaim of the shared pool), so both caches change every round.
        _churn(kv=kvs[round_ % 2], round_=round_, check=check)
    cached = sum(int(kv.stats()["num_cached_blocks"]) for kv in kvs)
    assert cached > 0
    assert pool.num_free_blocks + cached == 16


def test_checks_racing_managers_raise_no_false_violation() -> None:
    """Two threads churn their managers on one pool while a third checks the pool in a loop
    and a fourth builds, uses and drops a manager on it over and over."""
    pool = pagedkv.BlockPool(num_blocks=96, block_size=BS)
    kvs = [pagedkv.KvCacheManager(pool=pool, enable_prefix_caching=True) for _ in range(2)]
    errors: list[BaseException] = []
    done = threading.Event()

    def worker(i: int) -> None:
        try:
            for round_ in range(30):
                _churn(kvs[i], 2 * round_ + i, kvs[i].check_invariants)
        except BaseException as error:  # noqa: BLE001 -- reported below
            errors.append(error)

    def checker() -> None:
        try:
            while not done.is_set():
                pool.check_invariants()
        except BaseException as error:  # noqa: BLE001 -- reported below
            errors.append(error)

    def outsider() -> None:
        try:
            for round_ in range(30):
                kv = pagedkv.KvCacheManager(pool=pool, enable_prefix_caching=True)
                kv.add_sequence(1, _prompt(500 + round_, 3))
                kv.free(1)
                kv.check_invariants()
                del kv
        except BaseException as error:  # noqa: BLE001 -- reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    threads.append(threading.Thread(target=outsider))
    watch = threading.Thread(target=checker)
    watch.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    watch.join()
    assert not errors, errors
    pool.check_invariants()
