"""Speculative-decoding conformance: draft (lookahead) slots are allocated like any appended
tokens, and the rejected ones roll back with ``truncate`` (the watermark drops with them, and
their blocks are never left cached), as vLLM v1's scheduler subtracts the rejected tokens from
``num_computed_tokens`` (facts carried over, not code). Conventions: docs/conformance.md.
"""

from __future__ import annotations

import pytest
from conformance_helpers import manager, removed_hashes, stored, table


@pytest.mark.parametrize(
    ("num_new", "num_lookahead", "blocks"),
    [(3, 2, 2), (3, 4, 2), (3, 6, 3)],
)
def test_lookahead_slots_take_blocks_like_tokens(num_new: int, num_lookahead: int, blocks: int) -> None:
    """An empty request scheduled for ``num_new`` tokens plus ``num_lookahead`` draft slots
    holds ``ceil((num_new + num_lookahead) / 4)`` blocks of 4.

    Mirrors vLLM v1 ``tests/v1/core/test_kv_cache_utils.py::test_allocate_with_lookahead``
    (3 + 2 and 3 + 4 tokens: 2 blocks of 4; 3 + 6 is this suite's extra case).
    """
    kv = manager(10, 4)
    kv.add_sequence(0, num_tokens=num_new)
    kv.append_tokens(0, num_tokens=num_lookahead)
    assert len(table(kv, 0)) == blocks
    kv.truncate(0, num_new)  # every draft rejected: back to the scheduled tokens
    assert len(table(kv, 0)) == 1
    assert kv.num_free_blocks == 9
    kv.check_invariants()


@pytest.mark.parametrize(
    ("drafts", "accepted"),
    [
        ([1, 2, 3], 3),  # perfect match: all drafts accepted
        ([1, 2, 3], 1),  # early mismatch: 1 accepted
        ([1, 2, 3], 0),  # first draft rejected
        ([], 0),  # no drafts
    ],
)
def test_rejected_drafts_roll_back(drafts: list[int], accepted: int) -> None:
    """A decoding request appends its drafts (computed in the verifying pass), and the
    rejected ones are truncated: length and ``num_computed_tokens`` drop by the number
    rejected, blocks that only rejected drafts filled go back to the pool and leave the index,
    and the accepted drafts' blocks stay.

    Mirrors vLLM v1 ``tests/v1/core/test_scheduler.py::test_schedule_spec_decoding_stats``
    (perfect match, early mismatch, empty drafts: ``num_computed_tokens`` minus the rejected
    tokens) and ``vllm/v1/core/sched/scheduler.py::update_from_output``.
    """
    kv = manager(8, 4, enable_kv_events=True)
    prompt = [9, 9, 9, 9, 9, 9]
    kv.add_sequence(0, prompt)
    kv.take_events()
    if drafts:
        kv.append_tokens(0, drafts)
    filled = stored(kv.take_events())  # a draft that completes block 1 stores it
    kv.truncate(0, len(prompt) + accepted)
    n = len(prompt) + accepted
    assert (kv.num_tokens(0), kv.num_computed_tokens(0)) == (n, n)
    assert len(table(kv, 0)) == -(-n // 4)
    removed = removed_hashes(kv.take_events())
    if filled and n < 8:  # block 1 now holds rejected drafts: it leaves the index
        assert removed == list(filled[0].block_hashes)
    else:
        assert removed == []
    assert kv.match_prefix(prompt + drafts[:accepted] + [0]) == (n // 4) * 4
    kv.check_invariants()


def test_rollback_never_modifies_a_block_another_request_holds() -> None:
    """A rejected block that another request shares keeps its content and its hash; the next
    write into the kept, shared partial block goes to a copy.

    Mirrors vLLM v1 ``tests/v1/core/test_prefix_caching.py::test_prefill`` (hit blocks are
    shared, refcount 2) under the rollback of ``test_schedule_spec_decoding_stats``.
    """
    kv = manager(8, 4)
    prompt = list(range(9))
    kv.add_sequence(0, prompt)
    assert kv.add_sequence(1, prompt) == 8
    kv.truncate(1, 6)  # into block 1, shared with request 0
    assert kv.refcount(table(kv, 0)[1]) == 2
    kv.append_tokens(1, [0])
    (copy,) = kv.take_copy_ops().tolist()
    assert copy[0] == table(kv, 0)[1] and table(kv, 1)[1] == copy[1]
    assert kv.match_prefix(prompt) == 8
    kv.check_invariants()
