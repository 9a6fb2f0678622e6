"""KvCacheManager.csr_page_table: FlashInfer's paged-KV layout, row by row the padded tables."""

from __future__ import annotations

import numpy as np
import pagedkv
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st


def check_against_padded(kv: pagedkv.KvCacheManager, seq_ids: list[int]) -> None:
    indptr, indices, last = kv.csr_page_table(seq_ids)
    tables, lens = kv.batch_block_tables(seq_ids)
    assert indptr.dtype == indices.dtype == last.dtype == np.int32
    assert indptr.shape == (len(seq_ids) + 1,) and last.shape == (len(seq_ids),)
    assert indptr[0] == 0 and indptr[-1] == indices.shape[0]
    bs = kv.block_size
    for row, seq in enumerate(seq_ids):
        blocks = indices[indptr[row] : indptr[row + 1]]
        assert blocks.tolist() == kv.block_table(seq).tolist()
        assert blocks.tolist() == tables[row, : len(blocks)].tolist()
        n = int(lens[row])
        assert (len(blocks) - 1) * bs + int(last[row]) == n if len(blocks) else n == 0 == int(last[row])
        if len(blocks):
            assert 1 <= last[row] <= bs


def test_small_example() -> None:
    kv = pagedkv.KvCacheManager(num_blocks=8, block_size=4)
    kv.add_sequence(1, num_tokens=6)
    kv.add_sequence(2, num_tokens=4)
    kv.add_sequence(3, num_tokens=0)
    indptr, indices, last = kv.csr_page_table([2, 1, 3])
    assert indptr.tolist() == [0, 1, 3, 3]
    assert indices.tolist() == kv.block_table(2).tolist() + kv.block_table(1).tolist()
    assert last.tolist() == [4, 2, 0]
    empty = kv.csr_page_table([])
    assert [a.tolist() for a in empty] == [[0], [], []]


def test_errors_are_typed_and_change_nothing() -> None:
    kv = pagedkv.KvCacheManager(num_blocks=8, block_size=4)
    kv.add_sequence(1, num_tokens=6)
    with pytest.raises(pagedkv.UnknownSequenceError):
        kv.csr_page_table([1, 99])
    with pytest.raises(pagedkv.InvalidArgumentError):
        kv.csr_page_table([1.5])  # type: ignore[list-item]
    with pytest.raises(pagedkv.InvalidArgumentError):
        kv.csr_page_table(np.array([[1]], np.int64))
    kv.check_invariants()
    check_against_padded(kv, [1])


@settings(max_examples=40, deadline=None)
@given(
    block_size=st.integers(1, 16),
    lens=st.lists(st.integers(0, 50), min_size=0, max_size=6),
    forks=st.lists(st.integers(0, 5), max_size=3),
    appends=st.lists(st.integers(0, 9), max_size=6),
)
def test_matches_padded_tables(block_size, lens, forks, appends) -> None:
    kv = pagedkv.KvCacheManager(num_blocks=512, block_size=block_size)
    for i, n in enumerate(lens):
        kv.add_sequence(i, num_tokens=n)
    next_id = len(lens)
    for f in forks:
        if f < len(lens):
            kv.fork(f, next_id)
            next_id += 1
    for i, a in enumerate(appends):
        if i < next_id and a:
            kv.append_tokens(i, num_tokens=a)
    ids = list(range(next_id))
    check_against_padded(kv, ids)
    check_against_padded(kv, ids[::-1])  # any order
    if ids:  # an id given twice is refused, as by batch_block_tables (results bounded by the pool)
        with pytest.raises(pagedkv.InvalidArgumentError, match="twice"):
            kv.csr_page_table(ids + ids[:1])
    kv.check_invariants()
