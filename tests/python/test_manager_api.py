"""KvCacheManager and BlockPool as docs/design.md, Python API, names them: keywords, dtypes, shapes."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pagedkv
import pytest

INTEGER_DTYPES = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64]


def test_version_and_cli() -> None:
    assert isinstance(pagedkv.__version__, str) and pagedkv.__version__
    out = subprocess.run(
        [sys.executable, "-m", "pagedkv", "--version"], capture_output=True, text=True, check=True
    )
    assert pagedkv.__version__ in out.stdout


def test_exports() -> None:
    for name in [
        "KvCacheManager",
        "BlockPool",
        "PagedKvError",
        "OutOfBlocksError",
        "UnknownSequenceError",
        "SequenceExistsError",
        "SequenceSwappedOutError",
        "InvalidArgumentError",
        "InvariantViolation",
        "BlockStored",
        "BlockRemoved",
        "AllBlocksCleared",
    ]:
        assert hasattr(pagedkv, name), name
        assert name in pagedkv.__all__


def test_defaults() -> None:
    kv = pagedkv.KvCacheManager()
    assert (kv.num_blocks, kv.block_size, kv.enable_prefix_caching, kv.num_host_blocks) == (
        1024,
        16,
        False,
        0,
    )
    assert kv.num_free_blocks == 1024 and kv.usage == 0.0 and len(kv) == 0
    pool = pagedkv.BlockPool()
    assert (pool.num_blocks, pool.block_size, pool.num_free_blocks) == (1024, 16, 1024)


def test_positional_and_keyword_construction() -> None:
    kv = pagedkv.KvCacheManager(64, 8, False, 0)
    assert (kv.num_blocks, kv.block_size) == (64, 8)
    kv = pagedkv.KvCacheManager(num_blocks=64, block_size=8, hash_seed=7, max_events=10)
    assert (kv.num_blocks, kv.block_size) == (64, 8)


def test_add_append_tables_and_slots() -> None:
    kv = pagedkv.KvCacheManager(num_blocks=16, block_size=4)
    assert kv.add_sequence(1, [10, 11, 12, 13, 14]) == 0
    table = kv.block_table(1)
    assert table.dtype == np.int32 and table.shape == (2,) and table.tolist() == [0, 1]
    assert kv.num_tokens(1) == 5 and 1 in kv and 2 not in kv and len(kv) == 1
    kv.append_tokens(1, [15, 16, 17])  # fills block 1 exactly
    assert kv.num_tokens(1) == 8 and kv.block_table(1).tolist() == [0, 1]
    kv.append_tokens(1)  # one id-less token
    assert kv.num_tokens(1) == 9 and len(kv.block_table(1)) == 3
    kv.append_tokens(1, num_tokens=3)
    assert kv.num_tokens(1) == 12
    kv.append_tokens(1, np.array([1, 2], dtype=np.int64), num_tokens=2)
    assert kv.num_tokens(1) == 14
    b = kv.block_table(1).tolist()
    slots = kv.slot_mapping([1], 3)
    assert slots.dtype == np.int64 and slots.shape == (3,)
    assert slots.tolist() == [b[2] * 4 + 3, b[3] * 4 + 0, b[3] * 4 + 1]
    assert kv.usage == pytest.approx(4 / 16)
    kv.check_invariants()


def test_block_table_is_a_fresh_array() -> None:
    kv = pagedkv.KvCacheManager(num_blocks=8, block_size=4)
    kv.add_sequence(1, num_tokens=5)
    table = kv.block_table(1)
    table[0] = 7
    assert kv.block_table(1).tolist() == [0, 1]


def test_add_sequence_token_inputs() -> None:
    # Prefix caching makes the token values observable: every form of the same 8 ids (two full
    # blocks of 4) reuses the first block the list stored (the last block of a fully cached
    # prompt is recomputed), so a form read with wrong values or length misses.
    kv = pagedkv.KvCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=True)
    ids = [1, 2, 3, 4, 5, 6, 7, 8]
    assert kv.add_sequence(1, ids) == 0
    forms: list[object] = [
        tuple(ids),
        *(np.array(ids, dtype=dtype) for dtype in INTEGER_DTYPES),
        np.repeat(np.array(ids, dtype=np.int64), 2)[::2],  # non-contiguous view
        [np.int64(t) if t % 2 else np.uint32(t) for t in ids],  # NumPy integer scalars
    ]
    for seq_id, form in enumerate(forms, start=10):
        assert kv.add_sequence(seq_id, form) == 4, form
        assert kv.num_tokens(seq_id) == 8 and kv.block_table(seq_id)[0] == kv.block_table(1)[0]
    assert kv.add_sequence(2, np.array([1, 2, 3, 5], dtype=np.uint8)) == 0  # other values: a miss
    kv.add_sequence(22, num_tokens=9)
    assert kv.num_tokens(22) == 9 and len(kv.block_table(22)) == 3
    assert kv.add_sequence(23, [0, 2**32 - 1]) == 0 and kv.num_tokens(23) == 2  # the full token-id range
    kv.add_sequence(2**64 - 1, [1])  # the full sequence-id range
    assert 2**64 - 1 in kv and kv.num_tokens(2**64 - 1) == 1
    kv.add_sequence(24, [1] * 100, num_tokens=100)  # agreeing count
    assert kv.num_tokens(24) == 100
    assert kv.num_sequences == 6 + len(forms)
    kv.check_invariants()


def test_fork_and_copy_on_write() -> None:
    kv = pagedkv.KvCacheManager(num_blocks=16, block_size=4)
    kv.add_sequence(1, [1, 2, 3, 4, 5, 6])  # blocks [0, 1], block 1 half full
    kv.fork(1, 2)
    assert kv.block_table(2).tolist() == [0, 1]
    assert kv.refcount(0) == 2 and kv.refcount(1) == 2
    empty = kv.take_copy_ops()
    assert empty.dtype == np.int32 and empty.shape == (0, 2)
    kv.append_tokens(2, [7])
    ops = kv.take_copy_ops()
    assert ops.dtype == np.int32 and ops.shape == (1, 2)
    new_block = kv.block_table(2)[1]
    assert ops.tolist() == [[1, int(new_block)]]
    assert kv.refcount(1) == 1 and kv.refcount(int(new_block)) == 1 and kv.refcount(0) == 2
    assert kv.take_copy_ops().shape == (0, 2)  # cleared by the call
    kv.append_tokens(1, [8])  # parent now sole owner of block 1: no copy
    assert kv.take_copy_ops().shape == (0, 2)
    assert kv.stats()["cow_copies"] == 1
    kv.check_invariants()


def test_full_shared_last_block_needs_no_copy() -> None:
    kv = pagedkv.KvCacheManager(num_blocks=16, block_size=4)
    kv.add_sequence(1, [1, 2, 3, 4, 5, 6, 7, 8])
    kv.fork(1, 2)
    kv.append_tokens(2, [9])
    assert kv.take_copy_ops().shape == (0, 2)
    assert kv.block_table(2).tolist()[:2] == kv.block_table(1).tolist()
    assert len(kv.block_table(2)) == 3


def test_textbook_parallel_sampling_uses_114_blocks() -> None:
    """4 samples from a 1,000-token prompt, 200 tokens each, block_size 16: the 62 full prompt
    blocks are shared once, each sample owns 13 (its partial-block copy + 12 more) = 114."""
    kv = pagedkv.KvCacheManager(num_blocks=512, block_size=16)
    kv.add_sequence(0, list(range(1000)))
    assert len(kv.block_table(0)) == 63
    for child in (1, 2, 3):
        kv.fork(0, child)
    for step in range(200):
        kv.append_tokens_batch([0, 1, 2, 3], [step] * 4)
        kv.check_invariants() if step % 50 == 0 else None
    assert kv.stats()["num_blocks_in_use"] == 114
    assert kv.num_free_blocks == 512 - 114
    assert kv.stats()["cow_copies"] == 3 and kv.take_copy_ops().shape == (3, 2)
    tables = [kv.block_table(s).tolist() for s in range(4)]
    assert all(len(t) == 75 for t in tables)
    assert all(t[:62] == tables[0][:62] for t in tables)
    assert len({b for t in tables for b in t[62:]}) == 4 * 13
    assert all(kv.refcount(b) == 4 for b in tables[0][:62])
    kv.check_invariants()
    kv.free_batch([0, 1, 2, 3])
    assert kv.num_free_blocks == 512 and kv.stats()["num_blocks_in_use"] == 0


def test_parallel_sampling_with_freed_parent_and_one_token_steps() -> None:
    kv = pagedkv.KvCacheManager(num_blocks=512, block_size=16)
    kv.add_sequence(100, np.arange(1000))
    for child in range(4):
        kv.fork(100, child)
    kv.free(100)
    for _ in range(200):
        for child in range(4):
            kv.append_tokens(child, [1])
    assert kv.stats()["num_blocks_in_use"] == 114  # the last writer needs no copy
    kv.check_invariants()


def test_batch_calls() -> None:
    kv = pagedkv.KvCacheManager(num_blocks=64, block_size=4)
    for seq_id in range(3):
        kv.add_sequence(seq_id, num_tokens=seq_id + 1)
    kv.append_tokens_batch([0, 1, 2], num_tokens=2)
    assert [kv.num_tokens(s) for s in range(3)] == [3, 4, 5]
    kv.append_tokens_batch(np.array([2, 0], dtype=np.int64), [7, 8, 9, 10], num_tokens=2)
    assert [kv.num_tokens(s) for s in range(3)] == [5, 4, 7]
    tables, lens = kv.batch_block_tables([0, 1, 2])
    assert tables.dtype == np.int32 and lens.dtype == np.int32
    assert tables.shape == (3, 2) and lens.tolist() == [5, 4, 7]
    assert tables[1].tolist() == kv.block_table(1).tolist() + [-1]
    slots = kv.slot_mapping(np.array([0, 2], dtype=np.uint64), 2)
    assert slots.shape == (4,) and slots.dtype == np.int64
    t0, t2 = kv.block_table(0).tolist(), kv.block_table(2).tolist()
    assert slots.tolist() == [t0[0] * 4 + 3, t0[1] * 4 + 0, t2[1] * 4 + 1, t2[1] * 4 + 2]
    empty_tables, empty_lens = kv.batch_block_tables([])
    assert empty_tables.shape[0] == 0 and empty_lens.shape == (0,)
    assert kv.can_append(0) and kv.can_append(0, 4) and not kv.can_append(0, 10**6)
    kv.free_batch((0, 1))  # a tuple works too
    assert 0 not in kv and 1 not in kv and 2 in kv
    kv.check_invariants()


def test_stats_keys() -> None:
    kv = pagedkv.KvCacheManager(num_blocks=8, block_size=4)
    kv.add_sequence(1, num_tokens=5)
    kv.fork(1, 2)
    kv.free(1)
    stats = kv.stats()
    assert isinstance(stats, dict)
    for key in [
        "num_blocks_in_use",
        "num_cached_blocks",
        "allocations",
        "frees",
        "cow_copies",
        "prefix_query_tokens",
        "prefix_hit_tokens",
        "evictions",
        "prefix_hit_rate",
    ]:
        assert key in stats, key
    assert stats["num_blocks_in_use"] == 2 and stats["allocations"] == 2 and stats["forks"] == 1
    assert stats["num_blocks_in_use"] + stats["num_cached_blocks"] + stats["num_free_list_blocks"] == 8


def test_one_name_per_quantity() -> None:
    """Free list only (``num_free_list_blocks``) versus free + cached-evictable
    (``num_available_blocks``), under the same name on the pool, the manager and in ``stats()``;
    the names docs/design.md fixes stay as aliases of the quantity they always meant."""
    pool = pagedkv.BlockPool(num_blocks=8, block_size=4)
    kv = pagedkv.KvCacheManager(pool=pool, enable_prefix_caching=True)
    kv.add_sequence(1, list(range(8)))  # two full blocks
    kv.add_sequence(2, num_tokens=5)  # two blocks
    kv.free(1)  # its two blocks stay cached-evictable
    stats = kv.stats()
    assert (stats["num_cached_blocks"], stats["num_blocks_in_use"]) == (2, 2)
    assert kv.num_free_list_blocks == pool.num_free_list_blocks == stats["num_free_list_blocks"] == 4
    assert kv.num_available_blocks == stats["num_available_blocks"] == 6
    assert kv.num_free_blocks == kv.num_available_blocks  # DESIGN's name: free + cached
    assert pool.num_free_blocks == pool.num_free_list_blocks  # DESIGN's name: free list
    assert "num_free_blocks" not in stats  # it meant the free list here, the sum on kv
    # The core's counter names, verbatim; DESIGN's three historical keys as aliases.
    for alias, core in [
        ("allocations", "blocks_allocated"),
        ("frees", "blocks_freed"),
        ("evictions", "blocks_evicted"),
    ]:
        assert stats[alias] == stats[core]
    assert stats["blocks_allocated"] == 4 and stats["blocks_freed"] == 2
    assert {"blocks_swapped_out", "blocks_swapped_in"} <= stats.keys()
    assert not {"swap_out_blocks", "swap_in_blocks"} & stats.keys()


def test_shared_pool() -> None:
    pool = pagedkv.BlockPool(num_blocks=32, block_size=8)
    a = pagedkv.KvCacheManager(pool=pool)
    b = pagedkv.KvCacheManager(pool=pool)
    assert a.pool is pool and (a.num_blocks, a.block_size) == (32, 8)
    a.add_sequence(1, num_tokens=80)  # 10 blocks
    b.add_sequence(1, num_tokens=40)  # 5 blocks, same caller id in another manager
    assert pool.num_free_blocks == 17 and a.num_free_blocks == 17 and b.num_free_blocks == 17
    assert not set(a.block_table(1).tolist()) & set(b.block_table(1).tolist())
    assert pool.refcount(int(a.block_table(1)[0])) == 1
    a.check_invariants()
    b.check_invariants()
    pool.check_invariants()
    a.free(1)
    b.free(1)
    assert pool.num_free_blocks == 32
    own = pagedkv.KvCacheManager(num_blocks=4, block_size=2)
    assert own.pool.num_blocks == 4 and own.pool is own.pool
    assert "BlockPool" in repr(pool) and "KvCacheManager" in repr(a)
