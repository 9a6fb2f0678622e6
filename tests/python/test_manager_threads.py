"""Thread safety from Python: several threads hammering one manager (its lock makes each call
atomic), and several managers, one per thread, on one shared lock-free BlockPool."""

from __future__ import annotations

import random
import threading

import numpy as np
import pagedkv
import pytest
from pagedkv import OutOfBlocksError, UnknownSequenceError

NUM_THREADS = 6
OPS_PER_THREAD = 3000


def run_threads(target, count: int) -> None:  # type: ignore[no-untyped-def]
    errors: list[BaseException] = []
    barrier = threading.Barrier(count)

    def wrapped(index: int) -> None:
        try:
            barrier.wait()
            target(index)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=wrapped, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def worker_ops(kv: pagedkv.KvCacheManager, index: int, shared_ids: bool) -> None:
    """A random mix of every call, including batch calls that release the GIL. With
    `shared_ids`, threads race on the same sequence ids, so typed errors are expected."""
    rng = random.Random(index)
    base = 0 if shared_ids else index * 1_000_000
    live: list[int] = []
    for step in range(OPS_PER_THREAD):
        op = rng.random()
        seq_id = base + rng.randrange(64) if shared_ids else base + step
        try:
            if op < 0.25 or not live:
                kv.add_sequence(seq_id, np.arange(rng.randrange(1, 700)) % 50)
                live.append(seq_id)
            elif op < 0.45:
                kv.append_tokens(rng.choice(live), [rng.randrange(50)])
            elif op < 0.55:
                kv.append_tokens_batch(live[-12:], num_tokens=rng.randrange(1, 4))
            elif op < 0.65:
                kv.fork(rng.choice(live), seq_id)
                live.append(seq_id)
            elif op < 0.75:
                victim = live.pop(rng.randrange(len(live)))
                kv.free(victim)
            elif op < 0.8:
                victims, live[:] = live[:10], live[10:]
                kv.free_batch(victims)
            elif op < 0.9:
                ids = live[-16:]
                tables, lens = kv.batch_block_tables(ids)
                assert tables.shape[0] == len(ids) and lens.shape == (len(ids),)
                kv.slot_mapping(ids, 1)
            elif op < 0.95 and kv.num_host_blocks:
                victim = rng.choice(live)
                kv.swap_out(victim)
                try:
                    kv.swap_in(victim)
                except OutOfBlocksError:
                    live.remove(victim)
                    kv.free(victim)
            else:
                kv.take_copy_ops()
                kv.stats()
                assert 0.0 <= kv.usage <= 1.0
        except OutOfBlocksError:
            if live:
                kv.free(live.pop(0)) if not shared_ids else None
        except (
            UnknownSequenceError,
            pagedkv.SequenceExistsError,
            pagedkv.InvalidArgumentError,
            pagedkv.SequenceSwappedOutError,
        ):
            if not shared_ids:
                raise
            live = [s for s in live if s in kv]
    if not shared_ids:
        kv.free_batch(live)


@pytest.mark.parametrize(("prefix_caching", "num_host_blocks"), [(False, 0), (True, 0), (False, 512)])
def test_threads_hammering_one_manager_with_disjoint_ids(prefix_caching: bool, num_host_blocks: int) -> None:
    kv = pagedkv.KvCacheManager(
        num_blocks=4096, block_size=16, enable_prefix_caching=prefix_caching, num_host_blocks=num_host_blocks
    )
    run_threads(lambda i: worker_ops(kv, i, shared_ids=False), NUM_THREADS)
    kv.check_invariants()
    assert len(kv) == 0 and kv.num_free_blocks == 4096
    assert kv.stats()["num_blocks_in_use"] == 0
    if prefix_caching:
        assert kv.stats()["prefix_hit_tokens"] > 0  # the prompts share prefixes
        kv.take_events()


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_threads_racing_on_the_same_ids(prefix_caching: bool) -> None:
    kv = pagedkv.KvCacheManager(
        num_blocks=2048, block_size=16, enable_prefix_caching=prefix_caching, num_host_blocks=256
    )
    run_threads(lambda i: worker_ops(kv, i, shared_ids=True), NUM_THREADS)
    kv.check_invariants()
    stats = kv.stats()
    assert stats["num_blocks_in_use"] + stats["num_cached_blocks"] + stats["num_free_list_blocks"] == 2048
    for seq_id in range(64):
        if seq_id in kv:
            kv.free(seq_id)
    kv.check_invariants()
    assert kv.num_free_blocks == 2048 and kv.num_free_host_blocks == 256


def test_managers_on_one_shared_pool() -> None:
    pool = pagedkv.BlockPool(num_blocks=3000, block_size=16)
    managers = [pagedkv.KvCacheManager(pool=pool) for _ in range(NUM_THREADS)]
    owned: list[set[int]] = [set() for _ in range(NUM_THREADS)]

    def work(index: int) -> None:
        kv = managers[index]
        worker_ops(kv, index, shared_ids=False)
        # Leave some sequences live so that ownership can be cross-checked afterwards.
        for seq_id in range(8):
            try:
                kv.add_sequence(seq_id, num_tokens=100)
            except OutOfBlocksError:
                continue
            owned[index].update(kv.block_table(seq_id).tolist())
        kv.check_invariants()  # safe while the other managers run

    run_threads(work, NUM_THREADS)
    for a in range(NUM_THREADS):
        for b in range(a + 1, NUM_THREADS):
            assert not owned[a] & owned[b], "a block owned by two managers"
    in_use = sum(kv.stats()["num_blocks_in_use"] for kv in managers)
    assert in_use == sum(len(o) for o in owned)
    assert pool.num_free_blocks == 3000 - in_use
    for kv in managers:
        kv.check_invariants()
        for seq_id in range(8):
            if seq_id in kv:
                kv.free(seq_id)
    pool.check_invariants()
    assert pool.num_free_blocks == 3000
