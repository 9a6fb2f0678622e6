"""Host swap tier through Python (docs/design.md, Swap tier): round-trip bookkeeping, shared blocks of a fork
group copied once, all-or-nothing on a full tier, and typed errors for swapped-out sequences."""

from __future__ import annotations

import numpy as np
import pagedkv
import pytest
from kv_test_helpers import snapshot
from pagedkv import (
    InvalidArgumentError,
    OutOfBlocksError,
    SequenceSwappedOutError,
    UnknownSequenceError,
)

BS = 4


def manager(num_blocks: int = 32, num_host_blocks: int = 32) -> pagedkv.KvCacheManager:
    return pagedkv.KvCacheManager(num_blocks=num_blocks, block_size=BS, num_host_blocks=num_host_blocks)


def test_round_trip_of_one_sequence() -> None:
    kv = manager()
    kv.add_sequence(1, list(range(10)))  # 3 blocks
    kv.add_sequence(2, num_tokens=5)  # a bystander
    table = kv.block_table(1).tolist()
    out = kv.swap_out(1)  # one id, not a list
    assert out.dtype == np.int32 and out.shape == (3, 2)
    assert sorted(out[:, 0].tolist()) == sorted(table)
    host_of = dict(out.tolist())
    assert len(set(host_of.values())) == 3
    assert kv.is_swapped_out(1) and not kv.is_swapped_out(2)
    assert kv.num_tokens(1) == 10 and 1 in kv
    assert kv.num_free_blocks == 32 - 2 and kv.num_free_host_blocks == 29
    assert all(kv.refcount(b) == 0 for b in table)
    stats = kv.stats()
    assert stats["num_swapped_sequences"] == 1 and stats["num_host_blocks_in_use"] == 3
    assert stats["blocks_swapped_out"] == 3
    kv.check_invariants()
    back = kv.swap_in([1])
    assert back.dtype == np.int32 and back.shape == (3, 2)
    device_of = dict(back.tolist())
    assert sorted(device_of) == sorted(host_of.values())
    new_table = kv.block_table(1).tolist()
    # Logical block i comes back holding what it held before: old -> host -> new.
    assert new_table == [device_of[host_of[b]] for b in table]
    assert not kv.is_swapped_out(1) and kv.num_free_host_blocks == 32
    assert kv.stats()["blocks_swapped_in"] == 3
    kv.append_tokens(1, [1, 2, 3])
    assert kv.num_tokens(1) == 13
    kv.check_invariants()


def test_fork_group_shares_host_blocks_and_device_blocks_again() -> None:
    kv = manager(num_blocks=64, num_host_blocks=64)
    kv.add_sequence(0, list(range(4 * BS + 2)))  # 4 full + 1 partial
    for child in (1, 2):
        kv.fork(0, child)
    kv.append_tokens(1, [99])  # child 1 copies the partial block
    kv.take_copy_ops()
    tables = {s: kv.block_table(s).tolist() for s in (0, 1, 2)}
    distinct = {b for t in tables.values() for b in t}
    assert len(distinct) == 6
    out = kv.swap_out([0, 1, 2])
    assert out.shape == (6, 2)  # each shared block copied once
    assert kv.stats()["num_host_blocks_in_use"] == 6
    assert kv.num_free_blocks == 64
    back = kv.swap_in([0, 1, 2])
    assert back.shape == (6, 2)
    host_of, device_of = dict(out.tolist()), dict(back.tolist())
    for seq_id, table in tables.items():
        assert kv.block_table(seq_id).tolist() == [device_of[host_of[b]] for b in table]
    shared = kv.block_table(0).tolist()[:4]
    assert kv.block_table(1).tolist()[:4] == shared == kv.block_table(2).tolist()[:4]
    assert all(kv.refcount(b) == 3 for b in shared)
    assert kv.refcount(kv.block_table(0).tolist()[4]) == 2  # seqs 0 and 2 still share it
    kv.append_tokens(2, [5])  # and copy-on-write still applies after the round trip
    assert kv.take_copy_ops().shape == (1, 2)
    kv.check_invariants()


def test_partial_group_is_supported() -> None:
    """Swapping out part of a fork group: the shared blocks keep their device copy for the
    members left behind, and come back as the swapped member's own blocks."""
    kv = manager()
    kv.add_sequence(0, list(range(2 * BS + 1)))
    kv.fork(0, 1)
    before = snapshot(kv, [0, 1])
    out = kv.swap_out([1])
    assert out.shape == (3, 2)
    assert kv.block_table(0).tolist() == before["tables"][0][0]
    assert all(kv.refcount(b) == 1 for b in kv.block_table(0).tolist())
    kv.check_invariants()
    kv.swap_in(1)
    assert not set(kv.block_table(0).tolist()) & set(kv.block_table(1).tolist())
    kv.check_invariants()


def test_full_host_tier_moves_nothing() -> None:
    kv = manager(num_blocks=32, num_host_blocks=4)
    kv.add_sequence(1, num_tokens=3 * BS)
    kv.add_sequence(2, num_tokens=2 * BS)
    kv.swap_out(1)
    before = snapshot(kv, [1, 2])
    with pytest.raises(OutOfBlocksError) as info:
        kv.swap_out(2)
    err = info.value
    assert (err.tier, err.needed_blocks, err.available_blocks, err.blocks_short) == (  # type: ignore[attr-defined]
        "host",
        2,
        1,
        1,
    )
    assert "host" in str(err)
    assert snapshot(kv, [1, 2]) == before
    kv.check_invariants()


def test_full_device_on_swap_in_moves_nothing() -> None:
    kv = manager(num_blocks=4, num_host_blocks=8)
    kv.add_sequence(1, num_tokens=3 * BS)
    kv.swap_out(1)
    kv.add_sequence(2, num_tokens=2 * BS)
    before = snapshot(kv, [1, 2])
    with pytest.raises(OutOfBlocksError) as info:
        kv.swap_in(1)
    assert info.value.tier == "device" and info.value.blocks_short == 1  # type: ignore[attr-defined]
    assert snapshot(kv, [1, 2]) == before
    kv.free(2)
    kv.swap_in(1)
    kv.check_invariants()


def test_swapped_out_sequences_refuse_growth_and_fork() -> None:
    kv = manager()
    kv.add_sequence(1, num_tokens=6)
    kv.add_sequence(2, num_tokens=6)
    kv.swap_out(1)
    before = snapshot(kv, [1, 2, 3])
    for op in [
        lambda: kv.append_tokens(1, [1]),
        lambda: kv.append_tokens(1),
        lambda: kv.append_tokens_batch([2, 1]),
        lambda: kv.fork(1, 3),
        lambda: kv.swap_out(1),
    ]:
        with pytest.raises(SequenceSwappedOutError):
            op()
        assert snapshot(kv, [1, 2, 3]) == before
    kv.free(1)  # a swapped-out sequence can be freed: its host blocks return
    assert kv.num_free_host_blocks == 32 and 1 not in kv
    kv.check_invariants()


def test_swap_errors() -> None:
    kv = manager()
    kv.add_sequence(1, num_tokens=6)
    before = snapshot(kv, [1])
    with pytest.raises(UnknownSequenceError):
        kv.swap_out([1, 9])
    with pytest.raises(UnknownSequenceError):
        kv.swap_in(9)
    with pytest.raises(InvalidArgumentError):
        kv.swap_out([1, 1])
    with pytest.raises(InvalidArgumentError):
        kv.swap_out(1.5)  # type: ignore[arg-type]
    with pytest.raises(pagedkv.PagedKvError):
        kv.swap_in(1)  # resident: nothing to swap in
    assert snapshot(kv, [1]) == before
    no_tier = pagedkv.KvCacheManager(num_blocks=8, block_size=BS)
    no_tier.add_sequence(1, num_tokens=3)
    with pytest.raises(pagedkv.PagedKvError):
        no_tier.swap_out(1)
    assert not no_tier.is_swapped_out(1)
    kv.check_invariants()
