"""Token ids as NumPy arrays: contiguous native uint32 / int32 arrays are read in place and
int64 ones narrowed in one pass (rust/pagedkv-python/src/id_batches.rs, `TokenIds`); every layout
and dtype must admit exactly what the same ids as a list admit, and refuse what a list refuses.
"""

from __future__ import annotations

import numpy as np
import pagedkv
import pytest

BS = 4
PROMPT = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]  # 2 full blocks + 3 tokens


def manager() -> pagedkv.KvCacheManager:
    return pagedkv.KvCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)


def as_layouts(ids: list[int]) -> list[object]:
    """The same ids in every array form the fast and the general paths read."""
    doubled = np.repeat(np.asarray(ids, dtype=np.int32), 2)
    readonly = np.asarray(ids, dtype=np.uint32)
    readonly.flags.writeable = False
    return [
        np.asarray(ids, dtype=np.uint32),  # borrowed
        np.asarray(ids, dtype=np.int32),  # borrowed after the sign check
        np.asarray(ids, dtype=np.int64),  # narrowed in one pass
        np.asarray(ids, dtype=np.uint64),  # general path
        np.asarray(ids, dtype=np.int16),  # general path
        doubled[::2],  # not contiguous: general path
        np.asarray(ids, dtype=">i4"),  # big-endian: general path
        readonly,
    ]


@pytest.mark.parametrize("layout", range(8))
def test_array_admits_exactly_what_the_list_admits(layout: int) -> None:
    expected = manager()
    expected.add_sequence(1, PROMPT)
    expected.free(1)
    hit_list = expected.add_sequence(2, PROMPT)
    table_list = expected.block_table(2).tolist()

    kv = manager()
    first = as_layouts(PROMPT)[layout]
    kv.add_sequence(1, first)
    kv.free(1)
    assert kv.add_sequence(2, as_layouts(PROMPT)[layout]) == hit_list == 8
    assert kv.block_table(2).tolist() == table_list
    assert kv.add_sequence(3, list(PROMPT)) == 8  # the array's ids were stored, not a view
    kv.check_invariants()


def test_stored_ids_do_not_alias_the_caller_array() -> None:
    kv = manager()
    ids = np.asarray(PROMPT, dtype=np.uint32)
    kv.add_sequence(1, ids)
    kv.free(1)
    ids[:] = 0  # the caller reuses its buffer
    assert kv.add_sequence(2, PROMPT) == 8
    kv.check_invariants()


@pytest.mark.parametrize(
    "bad",
    [
        np.asarray([1, -1, 2], dtype=np.int32),
        np.asarray([1, -(2**40), 2], dtype=np.int64),
        np.asarray([1, 2**32, 2], dtype=np.int64),
    ],
)
def test_out_of_range_ids_are_refused_without_change(bad: np.ndarray) -> None:
    kv = manager()
    before = kv.stats()
    with pytest.raises(pagedkv.InvalidArgumentError, match="token id must be an int"):
        kv.add_sequence(1, bad)
    assert kv.stats() == before
    kv.check_invariants()


def test_array_appends_match_list_appends() -> None:
    kv = manager()
    kv.add_sequence(1, np.asarray(PROMPT[:3], dtype=np.int32))
    kv.append_tokens(1, np.asarray(PROMPT[3:], dtype=np.uint32))
    kv.free(1)
    assert kv.add_sequence(2, PROMPT) == 8
