"""Every exception, typed, with the state unchanged afterwards (docs/design.md,
Invariants 6): bad counts, bad sizes, unknown and duplicate ids, double free, floats, bools, 2-D
arrays, out-of-range ids, "not now" (OutOfBlocksError) versus "never" (InvalidArgumentError)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pagedkv
import pytest
from kv_test_helpers import snapshot
from pagedkv import (
    InvalidArgumentError,
    OutOfBlocksError,
    PagedKvError,
    SequenceExistsError,
    UnknownSequenceError,
)


def make() -> pagedkv.KvCacheManager:
    """Two sequences sharing a partial block, 5 of 8 blocks in use... see the asserts."""
    kv = pagedkv.KvCacheManager(num_blocks=8, block_size=4)
    kv.add_sequence(1, [1, 2, 3, 4, 5, 6])
    kv.fork(1, 2)
    kv.add_sequence(3, num_tokens=9)
    return kv


IDS = [1, 2, 3, 4, 5]


def assert_fails_cleanly(
    kv: pagedkv.KvCacheManager, error: type[BaseException], op: Callable[[], Any]
) -> BaseException:
    before = snapshot(kv, IDS)
    with pytest.raises(error) as info:
        op()
    assert isinstance(info.value, PagedKvError)
    assert str(info.value)
    assert snapshot(kv, IDS) == before
    kv.check_invariants()
    return info.value


def test_exception_hierarchy() -> None:
    assert issubclass(pagedkv.UnknownSequenceError, KeyError)
    assert issubclass(pagedkv.InvalidArgumentError, ValueError)
    for cls in [
        OutOfBlocksError,
        UnknownSequenceError,
        SequenceExistsError,
        InvalidArgumentError,
        pagedkv.SequenceSwappedOutError,
        pagedkv.InvariantViolation,
    ]:
        assert issubclass(cls, PagedKvError)


@pytest.mark.parametrize(
    ("num_blocks", "block_size"),
    [
        (0, 16),
        (16, 0),
        (-1, 16),
        (16, -4),
        (2**31, 16),
        (2**64, 16),
        (1.5, 16),
        (16, 2.0),
        (True, 16),
        ("16", 16),
        (None, 0),
    ],
)
def test_bad_construction(num_blocks: Any, block_size: Any) -> None:
    with pytest.raises(InvalidArgumentError):
        pagedkv.KvCacheManager(num_blocks=num_blocks, block_size=block_size)
    if num_blocks is not None:
        with pytest.raises(InvalidArgumentError):
            pagedkv.BlockPool(num_blocks=num_blocks, block_size=block_size)


def test_bad_pool_arguments() -> None:
    pool = pagedkv.BlockPool(num_blocks=8, block_size=4)
    with pytest.raises(InvalidArgumentError):
        pagedkv.KvCacheManager(pool="not a pool")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        pagedkv.KvCacheManager(num_blocks=16, pool=pool)
    with pytest.raises(InvalidArgumentError):
        pagedkv.KvCacheManager(block_size=8, pool=pool)
    kv = pagedkv.KvCacheManager(num_blocks=8, block_size=4, pool=pool)  # agreeing is fine
    assert kv.num_blocks == 8
    with pytest.raises(InvalidArgumentError):
        pagedkv.KvCacheManager(num_host_blocks=-1)
    with pytest.raises(InvalidArgumentError):
        pagedkv.KvCacheManager(hash_seed=-1)
    with pytest.raises(InvalidArgumentError):
        pagedkv.KvCacheManager(enable_prefix_caching=1)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        pagedkv.KvCacheManager(max_events=-5)


def test_duplicate_and_unknown_ids() -> None:
    kv = make()
    err = assert_fails_cleanly(kv, SequenceExistsError, lambda: kv.add_sequence(1, [1]))
    assert err.seq_id == 1  # type: ignore[attr-defined]
    assert_fails_cleanly(kv, SequenceExistsError, lambda: kv.add_sequence(3, num_tokens=1))
    assert_fails_cleanly(kv, SequenceExistsError, lambda: kv.fork(1, 2))  # fork onto existing id
    assert_fails_cleanly(kv, SequenceExistsError, lambda: kv.fork(1, 1))
    err = assert_fails_cleanly(kv, UnknownSequenceError, lambda: kv.fork(9, 10))
    assert err.seq_id == 9  # type: ignore[attr-defined]
    assert isinstance(err, KeyError)
    for op in [
        lambda: kv.append_tokens(9, [1]),
        lambda: kv.append_tokens(9),
        lambda: kv.free(9),
        lambda: kv.block_table(9),
        lambda: kv.num_tokens(9),
        lambda: kv.can_append(9),
        lambda: kv.batch_block_tables([1, 9]),
        lambda: kv.slot_mapping([1, 9], 1),
        lambda: kv.append_tokens_batch([1, 9]),
        lambda: kv.free_batch([1, 2, 9]),  # validates all ids first: 1 and 2 stay live
    ]:
        assert_fails_cleanly(kv, UnknownSequenceError, op)


def test_double_free() -> None:
    kv = make()
    kv.free(3)
    assert_fails_cleanly(kv, UnknownSequenceError, lambda: kv.free(3))
    assert_fails_cleanly(kv, PagedKvError, lambda: kv.free_batch([1, 1]))


def test_duplicate_ids_in_a_batch() -> None:
    kv = make()
    assert_fails_cleanly(kv, InvalidArgumentError, lambda: kv.append_tokens_batch([1, 1]))


@pytest.mark.parametrize(
    "bad_ids",
    [range(2), {1, 2}, 1, "12", np.array([[1, 2]]), np.array([1.0, 2.0]), np.array([-1, 1])],
    ids=repr,
)
def test_bad_sequence_id_lists(bad_ids: Any) -> None:
    kv = make()
    for op in [
        lambda: kv.free_batch(bad_ids),
        lambda: kv.append_tokens_batch(bad_ids),
        lambda: kv.batch_block_tables(bad_ids),
        lambda: kv.slot_mapping(bad_ids, 1),
    ]:
        assert_fails_cleanly(kv, InvalidArgumentError, op)


@pytest.mark.parametrize(
    "bad_tokens",
    [
        [1.0],
        [1, 2.5],
        [True],
        [-1],
        [2**32],
        [2**70],
        ["1"],
        [None],
        [[1, 2]],
        np.array([1.0, 2.0]),
        np.array([[1, 2], [3, 4]]),
        np.array(5),
        np.array([True, False]),
        np.array([-1, 2], dtype=np.int64),
        np.array([2**32], dtype=np.uint64),
        "abc",
        b"abc",
        {1, 2},
        range(3),  # lazy iterables are refused: their length is not bounded by memory
        (i for i in range(3)),
        3,
        3.0,
    ],
    ids=repr,
)
def test_bad_token_ids(bad_tokens: Any) -> None:
    kv = make()
    assert_fails_cleanly(kv, InvalidArgumentError, lambda: kv.add_sequence(5, bad_tokens))
    assert_fails_cleanly(kv, InvalidArgumentError, lambda: kv.append_tokens(1, bad_tokens))
    assert 5 not in kv


@pytest.mark.parametrize("bad_id", [-1, 2**64, 1.0, 1.5, True, "1", None, [1], np.float64(1)], ids=repr)
def test_bad_sequence_ids(bad_id: Any) -> None:
    kv = make()
    for op in [
        lambda: kv.add_sequence(bad_id, [1]),
        lambda: kv.append_tokens(bad_id, [1]),
        lambda: kv.fork(1, bad_id),
        lambda: kv.fork(bad_id, 7),
        lambda: kv.free(bad_id),
        lambda: kv.block_table(bad_id),
        lambda: kv.num_tokens(bad_id),
        lambda: kv.free_batch([1, bad_id]),
        lambda: kv.append_tokens_batch([bad_id]),
        lambda: kv.batch_block_tables([bad_id]),
        lambda: kv.slot_mapping([bad_id], 1),
    ]:
        assert_fails_cleanly(kv, InvalidArgumentError, op)
    # Sequence 1 is live: a membership test that coerced 1.0, True, "1", [1] or np.float64(1) to
    # the id 1 would answer True here. `in` never raises, whatever the type.
    assert (bad_id in kv) is False
    assert kv.num_sequences == 3 and all(seq_id in kv for seq_id in (1, 2, 3))


@pytest.mark.parametrize("bad_count", [-1, -(2**70), 2**70, 1.5, True, "3"], ids=repr)
def test_bad_counts(bad_count: Any) -> None:
    kv = make()
    for op in [
        lambda: kv.add_sequence(5, num_tokens=bad_count),
        lambda: kv.append_tokens(1, num_tokens=bad_count),
        lambda: kv.can_append(1, bad_count),
        lambda: kv.append_tokens_batch([1, 3], num_tokens=bad_count),
        lambda: kv.slot_mapping([1], bad_count),
        lambda: kv.refcount(bad_count),
    ]:
        assert_fails_cleanly(kv, InvalidArgumentError, op)


def test_absurd_counts_never_fit() -> None:
    kv = make()
    for op in [
        lambda: kv.add_sequence(5, num_tokens=2**40),
        lambda: kv.add_sequence(5, num_tokens=8 * 4 + 1),  # one block more than the pool
        lambda: kv.append_tokens(1, num_tokens=2**40),
        lambda: kv.append_tokens_batch([1, 3], num_tokens=2**62),
        lambda: kv.slot_mapping([1], 7),  # more tokens than the sequence holds
        lambda: kv.refcount(8),  # block id out of range
        lambda: kv.add_sequence(5, [1, 2], num_tokens=3),  # disagreeing count
        lambda: kv.append_tokens(1, [1, 2], num_tokens=1),
        lambda: kv.append_tokens_batch([1, 3], [1, 2, 3], num_tokens=1),  # B * n mismatch
        lambda: kv.add_sequence(5, num_tokens=2, extra_key="salt"),  # extra_key needs ids
        lambda: kv.add_sequence(5, [1], extra_key=1.5),
    ]:
        assert_fails_cleanly(kv, InvalidArgumentError, op)


def test_out_of_blocks_now_is_retryable() -> None:
    kv = make()
    free = kv.num_free_blocks
    assert free == 3
    err = assert_fails_cleanly(kv, OutOfBlocksError, lambda: kv.add_sequence(5, num_tokens=16))
    assert (err.tier, err.needed_blocks, err.available_blocks, err.blocks_short) == (  # type: ignore[attr-defined]
        "device",
        4,
        3,
        1,
    )
    assert "device" in str(err) and "1" in str(err)
    assert_fails_cleanly(kv, OutOfBlocksError, lambda: kv.append_tokens(3, num_tokens=16))
    # The batch is all-or-nothing: 3 sequences each needing blocks, only 3 free.
    kv.append_tokens(3, num_tokens=3)  # seq 3 now exactly fills its 3 blocks
    assert kv.num_free_blocks == 3
    err = assert_fails_cleanly(kv, OutOfBlocksError, lambda: kv.append_tokens_batch([1, 2, 3], num_tokens=7))
    assert err.blocks_short >= 1  # type: ignore[attr-defined]
    assert not kv.can_append(3, 13)
    kv.free(3)  # after others free blocks, the retry succeeds
    kv.add_sequence(5, num_tokens=16)
    kv.check_invariants()


def test_not_a_type_error() -> None:
    kv = make()
    with pytest.raises(ValueError):
        kv.append_tokens(1, np.zeros((1, 1), dtype=np.int32))
    try:
        kv.append_tokens(1, [1.0])
    except TypeError:  # pragma: no cover - the assertion below explains
        pytest.fail("wrong argument types must raise InvalidArgumentError, not TypeError")
    except InvalidArgumentError as err:
        assert any("token_ids" in note for note in getattr(err, "__notes__", []))


def test_reentrant_index_does_not_deadlock() -> None:
    """Arguments are converted before the manager's lock is taken, so Python code run during
    conversion (an ``__index__``) may call the same manager."""
    kv = make()

    class Reentrant:
        def __index__(self) -> int:
            kv.free(3)
            return 5

    kv.add_sequence(7, [1, Reentrant(), 2])
    assert 3 not in kv and kv.num_tokens(7) == 3
    kv.check_invariants()
