"""``BlockPool.allocate`` / ``retain`` / ``release`` with generation-checked handles
(docs/pool.md): a repeated release raises ``DoubleFreeError``, a release or retain after the
block was handed out again raises ``StaleHandleError``; each is also an
``InvalidArgumentError`` and changes nothing."""

from __future__ import annotations

import pagedkv
import pytest
from pagedkv import (
    BlockHandle,
    DoubleFreeError,
    InvalidArgumentError,
    OutOfBlocksError,
    StaleHandleError,
)


def test_allocate_retain_release_round_trip() -> None:
    pool = pagedkv.BlockPool(num_blocks=4, block_size=16)
    handles = pool.allocate(3)
    assert [h.block_id for h in handles] == [0, 1, 2]
    assert all(isinstance(h, BlockHandle) for h in handles)
    assert pool.num_free_blocks == 1
    assert pool.retain(handles[1]) == 2
    assert [pool.release(h) for h in handles] == [True, False, True]
    assert pool.release(handles[1]) is True
    assert pool.num_free_blocks == 4
    pool.check_invariants()
    (kept,) = pool.allocate(1)
    with pytest.raises(OutOfBlocksError):
        pool.allocate(4)  # fits the pool, not now
    with pytest.raises(InvalidArgumentError):
        pool.allocate(5)  # never fits
    assert pool.num_free_blocks == 3 and pool.release(kept)
    with pytest.raises(TypeError):
        BlockHandle()  # type: ignore[call-arg]


def test_double_free_raises_its_own_class() -> None:
    pool = pagedkv.BlockPool(num_blocks=2, block_size=16)
    (handle,) = pool.allocate(1)
    assert pool.release(handle) is True
    with pytest.raises(DoubleFreeError) as info:
        pool.release(handle)
    assert type(info.value) is DoubleFreeError
    assert isinstance(info.value, InvalidArgumentError) and isinstance(info.value, ValueError)
    assert info.value.block_id == handle.block_id  # type: ignore[attr-defined]
    assert "double free" in str(info.value)
    assert pool.num_free_blocks == 2 and pool.refcount(handle.block_id) == 0
    pool.check_invariants()


def test_stale_handle_raises_its_own_class_and_spares_the_new_tenant() -> None:
    pool = pagedkv.BlockPool(num_blocks=1, block_size=16)
    (mine,) = pool.allocate(1)
    pool.release(mine)
    (theirs,) = pool.allocate(1)
    assert theirs.block_id == mine.block_id and theirs.generation != mine.generation
    assert theirs != mine and theirs == theirs
    for op in (pool.release, pool.retain):
        with pytest.raises(StaleHandleError) as info:
            op(mine)
        assert type(info.value) is StaleHandleError
        assert isinstance(info.value, InvalidArgumentError)
        assert info.value.block_id == mine.block_id  # type: ignore[attr-defined]
        assert info.value.generation == mine.generation  # type: ignore[attr-defined]
        assert pool.refcount(theirs.block_id) == 1
    assert pool.release(theirs) is True
    pool.check_invariants()


def test_a_handle_works_only_on_its_own_pool() -> None:
    a = pagedkv.BlockPool(num_blocks=2, block_size=16)
    b = pagedkv.BlockPool(num_blocks=2, block_size=16)
    (ha,) = a.allocate(1)
    (hb,) = b.allocate(1)
    assert ha.block_id == hb.block_id and ha != hb
    with pytest.raises(InvalidArgumentError, match="another BlockPool"):
        b.release(ha)
    assert b.refcount(hb.block_id) == 1
    with pytest.raises(TypeError):
        a.release(ha.block_id)  # type: ignore[arg-type]


def test_blocks_allocated_from_a_shared_pool_are_not_the_managers() -> None:
    pool = pagedkv.BlockPool(num_blocks=4, block_size=4)
    kv = pagedkv.KvCacheManager(pool=pool)
    handles = pool.allocate(2)
    kv.add_sequence(1, num_tokens=8)
    with pytest.raises(OutOfBlocksError):
        kv.add_sequence(2, num_tokens=1)
    assert sorted(h.block_id for h in handles) != sorted(kv.block_table(1).tolist())
    for h in handles:
        pool.release(h)
    kv.add_sequence(2, num_tokens=1)
    kv.check_invariants()
