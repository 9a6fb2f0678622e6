"""Hostile input to the scheduler-facing calls: ``add_sequence(num_scheduled=)``,
``advance_computed``, ``num_computed_tokens``, ``match_prefix``, ``truncate``,
``pin_prefix`` / ``unpin_prefix``. Floats, bools, negative and huge numbers, unknown ids,
wrong types: each raises a typed ``pagedkv`` error and changes nothing (docs/design.md,
Invariants 6)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pagedkv
import pytest
from kv_test_helpers import snapshot
from pagedkv import InvalidArgumentError, PagedKvError, SequenceSwappedOutError, UnknownSequenceError

IDS = [1, 2, 3, 4]
HUGE = 2**64
BAD_COUNTS = [-1, 1.5, float("nan"), HUGE, "3", None, [1], np.float32(2.0)]


def make() -> pagedkv.KvCacheManager:
    """1 prefilling (4 of 10 computed), 2 computed, 3 swapped out, one pinned prefix."""
    kv = pagedkv.KvCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True, num_host_blocks=4)
    kv.add_sequence(1, list(range(10)), num_scheduled=4)
    kv.add_sequence(2, [7] * 9)
    kv.add_sequence(3, [5] * 3)
    kv.swap_out(3)
    assert kv.pin_prefix([7] * 8) == 8
    return kv


def fails_cleanly(
    kv: pagedkv.KvCacheManager, op: Callable[[], Any], error: type[BaseException] = PagedKvError
) -> None:
    before = snapshot(kv, IDS)
    pinned = kv.stats()["num_pinned_blocks"]
    with pytest.raises(error) as info:
        op()
    assert isinstance(info.value, PagedKvError), type(info.value)
    assert snapshot(kv, IDS) == before
    assert kv.stats()["num_pinned_blocks"] == pinned
    kv.check_invariants()


@pytest.mark.parametrize("bad", BAD_COUNTS)
def test_bad_counts(bad: Any) -> None:
    kv = make()
    if bad is not None:  # (None is num_scheduled's default: everything scheduled)
        fails_cleanly(kv, lambda: kv.add_sequence(9, [1, 2, 3], num_scheduled=bad))
        fails_cleanly(kv, lambda: kv.add_sequence(9, num_tokens=3, num_scheduled=bad))
    fails_cleanly(kv, lambda: kv.advance_computed([1], bad))
    fails_cleanly(kv, lambda: kv.truncate(2, bad))


@pytest.mark.parametrize("bad", [True, 1.0, -1, HUGE, "1", None, object()])
def test_bad_ids(bad: Any) -> None:
    kv = make()
    fails_cleanly(kv, lambda: kv.advance_computed([bad], 1))
    fails_cleanly(kv, lambda: kv.advance_computed(bad, 1))
    fails_cleanly(kv, lambda: kv.num_computed_tokens(bad))
    fails_cleanly(kv, lambda: kv.truncate(bad, 0))


@pytest.mark.parametrize(
    "bad_tokens",
    [
        [1.5],
        [-1],
        [HUGE],
        ["a"],
        [[1, 2]],
        np.zeros((2, 2), dtype=np.int64),
        np.array([1.0]),
        "abcd",
        None,
        5,
    ],
)
def test_bad_token_lists(bad_tokens: Any) -> None:
    kv = make()
    fails_cleanly(kv, lambda: kv.match_prefix(bad_tokens))
    fails_cleanly(kv, lambda: kv.pin_prefix(bad_tokens))
    fails_cleanly(kv, lambda: kv.unpin_prefix(bad_tokens))


def test_state_errors() -> None:
    kv = make()
    fails_cleanly(kv, lambda: kv.advance_computed([1], 7), InvalidArgumentError)  # 6 left
    fails_cleanly(kv, lambda: kv.advance_computed([1, 2], 1), InvalidArgumentError)  # 2 is done
    fails_cleanly(kv, lambda: kv.advance_computed([1, 1], 1), InvalidArgumentError)
    fails_cleanly(kv, lambda: kv.advance_computed([1, 99], 1), UnknownSequenceError)
    fails_cleanly(kv, lambda: kv.advance_computed([3], 0), SequenceSwappedOutError)
    fails_cleanly(kv, lambda: kv.num_computed_tokens(99), UnknownSequenceError)
    fails_cleanly(kv, lambda: kv.truncate(2, 10), InvalidArgumentError)
    fails_cleanly(kv, lambda: kv.truncate(99, 0), UnknownSequenceError)
    fails_cleanly(kv, lambda: kv.truncate(3, 0), SequenceSwappedOutError)
    fails_cleanly(kv, lambda: kv.append_tokens(1, [1]), InvalidArgumentError)  # prefilling
    fails_cleanly(kv, lambda: kv.fork(1, 9), InvalidArgumentError)
    fails_cleanly(kv, lambda: kv.unpin_prefix([7] * 8, extra_key="other"), InvalidArgumentError)
    fails_cleanly(kv, lambda: kv.unpin_prefix([6] * 8), InvalidArgumentError)
    fails_cleanly(kv, lambda: kv.match_prefix([1, 2], extra_key=1.5))  # type: ignore[arg-type]


def test_pure_queries_on_valid_input_change_nothing() -> None:
    kv = make()
    before = snapshot(kv, IDS)
    assert kv.match_prefix([7] * 9) == 8
    assert kv.match_prefix(np.array([7] * 9, dtype=np.int32)) == 8
    assert kv.match_prefix([]) == 0
    assert kv.num_computed_tokens(1) == 4 and kv.num_computed_tokens(3) == 3
    assert snapshot(kv, IDS) == before
