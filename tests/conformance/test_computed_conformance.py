"""Computed-watermark conformance: with chunked prefill a block is cached (indexed, reported
in ``BlockStored``, hittable) only once every token in it is scheduled, as vLLM v1's
``allocate_slots`` caches ``min(num_computed_tokens + num_new_tokens, num_tokens)`` tokens'
worth of full blocks and nothing past them (facts carried over, not code). Conventions:
docs/conformance.md.
"""

from __future__ import annotations

import pagedkv
import pytest
from conformance_helpers import manager, stored, table


def test_only_full_computed_blocks_are_cached_chunk_by_chunk() -> None:
    """14 tokens in blocks of 4: a chunk covering 2 full blocks caches those 2 (one
    ``BlockStored`` of 2 hashes); the next chunk completing block 2 caches it alone, chained to
    block 1; the last 2 tokens fill no block and cache nothing.

    Mirrors vLLM v1 ``tests/v1/core/test_prefix_caching.py::test_cache_blocks`` (14 tokens,
    block size 4: ``cache_full_blocks`` with ``num_full_blocks=2`` caches 2 blocks, then with
    ``num_cached_blocks=2, num_full_blocks=3`` one more).
    """
    kv = manager(5, 4, enable_kv_events=True)
    tokens = list(range(14))
    assert kv.add_sequence(0, tokens, num_scheduled=8) == 0
    (first,) = stored(kv.take_events())
    assert len(first.block_hashes) == 2 and first.parent_block_hash is None
    assert kv.match_prefix(tokens) == 8

    kv.advance_computed([0], 4)
    (second,) = stored(kv.take_events())
    assert len(second.block_hashes) == 1
    assert second.parent_block_hash == first.block_hashes[-1]
    assert list(second.token_ids) == [8, 9, 10, 11]
    assert kv.match_prefix(tokens) == 12

    kv.advance_computed([0], 2)
    assert kv.take_events() == []
    assert kv.num_computed_tokens(0) == 14
    kv.check_invariants()


@pytest.mark.parametrize("chunk", [1, 5, 16, 17, 40])
def test_a_request_arriving_mid_prefill_hits_only_the_scheduled_blocks(chunk: int) -> None:
    """Request 0 (3 blocks of 16 + 7 tokens) is prefilled in chunks of ``chunk`` tokens; after
    every chunk, a request with the same prompt would hit exactly the full blocks the chunks so
    far cover (never the last prompt token), and the one admitted at the end shares them.

    Mirrors vLLM v1 ``tests/v1/core/test_prefix_caching.py::test_prefill`` (a hit on the blocks
    of a request still in use shares them), with ``KVCacheManager.allocate_slots`` caching only
    up to ``num_computed_tokens + num_new_tokens`` per step (the chunked-prefill schedule).
    """
    kv = manager(16)
    prompt = [i for i in range(3) for _ in range(16)] + [3] * 7
    kv.add_sequence(0, prompt, num_scheduled=chunk)
    computed = min(chunk, len(prompt))
    while True:
        assert kv.num_computed_tokens(0) == computed
        assert kv.match_prefix(prompt) == min(computed // 16, 3) * 16
        if computed == len(prompt):
            break
        step = min(chunk, len(prompt) - computed)
        kv.advance_computed([0], step)
        computed += step
    assert kv.add_sequence(1, prompt) == 48
    assert table(kv, 1)[:3] == table(kv, 0)[:3]
    assert [kv.refcount(b) for b in table(kv, 0)[:3]] == [2, 2, 2]
    kv.check_invariants()


def test_a_prefilling_request_cannot_decode_until_its_prompt_is_computed() -> None:
    """Output tokens are appended only after the whole prompt is scheduled (the scheduler's
    order in vLLM v1: a request samples once ``num_computed_tokens`` reaches its prompt
    length); pagedkv refuses the append with ``InvalidArgumentError`` and changes nothing.

    Mirrors vLLM v1 ``tests/v1/core/test_scheduler.py`` chunked-prefill schedules (a partial
    prefill yields no sampled token).
    """
    kv = manager(8, 4)
    kv.add_sequence(0, list(range(10)), num_scheduled=4)
    with pytest.raises(pagedkv.InvalidArgumentError):
        kv.append_tokens(0, [1])
    assert kv.num_tokens(0) == 10
    kv.advance_computed([0], 6)
    kv.append_tokens(0, [1])
    assert (kv.num_tokens(0), kv.num_computed_tokens(0)) == (11, 11)
