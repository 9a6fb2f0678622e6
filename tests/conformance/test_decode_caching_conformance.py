"""Decode-time caching conformance: blocks that decode fills (``append_tokens`` /
``append_tokens_batch``) are indexed and reported like prefill blocks, each on its own
sequence's hash chain, as vLLM v1 asserts in its allocator tests (facts carried over, not
code). Conventions: docs/conformance.md.
"""

from __future__ import annotations

from conformance_helpers import BS, manager, stored, table


def test_decode_caches_a_block_once_appended_tokens_fill_it() -> None:
    """Appends that stay inside the partial last block allocate nothing and index nothing;
    the append that fills it indexes exactly that block (one ``BlockStored``, chained to the
    block before it) and opens one new, unindexed block.

    Mirrors vLLM v1 ``tests/v1/core/test_prefix_caching.py::test_decode``: 3 full blocks + 7
    tokens; 4 appended tokens need no new block and leave the last block without a hash; 19
    more (9 fill the block, 10 go into a new one) allocate one block, the filled block gets its
    hash and the new last block has none.
    """
    kv = manager(10, enable_kv_events=True)
    prompt = [i for i in range(3) for _ in range(BS)] + [3] * 7
    assert kv.add_sequence(0, prompt) == 0
    assert table(kv, 0) == [0, 1, 2, 3]
    (prefill,) = stored(kv.take_events())
    assert len(prefill.block_hashes) == 3

    kv.append_tokens(0, [8] * 4)
    assert table(kv, 0) == [0, 1, 2, 3]
    assert kv.take_events() == []
    # The partial block is not hittable: a prompt covering it hits only the 3 full blocks.
    assert kv.add_sequence(1, prompt + [8] * 4 + [1]) == 3 * BS
    kv.free(1)

    kv.append_tokens(0, [7] * 19)
    assert len(table(kv, 0)) == 5 and table(kv, 0)[:4] == [0, 1, 2, 3]
    events = kv.take_events()
    assert len(events) == 1
    (filled,) = stored(events)
    assert len(filled.block_hashes) == 1
    assert filled.parent_block_hash == prefill.block_hashes[-1]
    assert list(filled.token_ids) == [3] * 7 + [8] * 4 + [7] * 5
    assert filled.block_size == BS
    # The filled block is hittable; the new last block (10 tokens) is not.
    grown = prompt + [8] * 4 + [7] * 19
    assert kv.add_sequence(2, grown + [7] * 6 + [1]) == 4 * BS
    assert table(kv, 2)[:4] == table(kv, 0)[:4]
    kv.check_invariants()


def test_batch_decode_stores_each_sequence_on_its_own_chain() -> None:
    """One batched decode step that fills a block in several sequences records one
    ``BlockStored`` per sequence (in batch order), each chained to that sequence's own last
    indexed block; a step that fills no block records nothing.

    Mirrors vLLM v1 ``test_prefix_caching.py::test_decode`` (a block completed by decode gets
    its hash) and ``::test_null_parent_block_hash`` (a later caching call's
    ``parent_block_hash`` is the hash of the request's own block before the new ones).
    """
    bs = 4
    kv = manager(32, block_size=bs, enable_kv_events=True)
    prompts = {seq: [100 * seq + i for i in range(bs + 2)] for seq in range(3)}
    for seq, prompt in prompts.items():
        kv.add_sequence(seq, prompt)
    first = dict(zip(prompts, stored(kv.take_events()), strict=True))
    assert all(len(e.block_hashes) == 1 and e.parent_block_hash is None for e in first.values())

    order = [2, 0, 1]
    new = {2: [1, 2], 0: [3, 4], 1: [5, 6]}
    kv.append_tokens_batch(order, [t for seq in order for t in new[seq]], num_tokens=2)
    events = kv.take_events()
    assert len(events) == 3
    for seq, event in zip(order, stored(events), strict=True):
        assert len(event.block_hashes) == 1
        assert event.parent_block_hash == first[seq].block_hashes[0]
        assert list(event.token_ids) == prompts[seq][bs:] + new[seq]

    kv.append_tokens_batch(order, [9, 9, 9])  # opens a fourth block in each: nothing full
    assert kv.take_events() == []
    for seq in prompts:
        assert kv.add_sequence(10 + seq, prompts[seq] + new[seq] + [0]) == 2 * bs
        assert table(kv, 10 + seq)[:2] == table(kv, seq)[:2]
    kv.check_invariants()


def test_a_later_caching_call_chains_to_the_last_hit_block() -> None:
    """A request that hits blocks another request stored reports only its own new blocks, with
    the last hit block's hash as their parent; its next decode-filled block chains to its own
    last stored block.

    Mirrors vLLM v1 ``test_prefix_caching.py::test_null_parent_block_hash``: caching blocks
    from ``num_cached_blocks`` on emits one ``BlockStored`` whose ``parent_block_hash`` is the
    request's hash of block ``num_cached_blocks - 1`` and whose ``block_hashes`` are exactly the
    newly cached blocks' hashes.
    """
    bs = 4
    kv = manager(16, block_size=bs, enable_kv_events=True)
    kv.add_sequence(0, list(range(2 * bs)) + [99])
    (base,) = stored(kv.take_events())
    assert len(base.block_hashes) == 2

    assert kv.add_sequence(1, list(range(4 * bs)) + [50]) == 2 * bs
    events = kv.take_events()
    assert len(events) == 1
    (own,) = stored(events)
    assert len(own.block_hashes) == 2 and not set(own.block_hashes) & set(base.block_hashes)
    assert own.parent_block_hash == base.block_hashes[-1]
    assert list(own.token_ids) == list(range(2 * bs, 4 * bs))

    kv.append_tokens(1, [51, 52, 53])
    (decoded,) = stored(kv.take_events())
    assert decoded.block_hashes != own.block_hashes
    assert decoded.parent_block_hash == own.block_hashes[-1]
    assert list(decoded.token_ids) == [50, 51, 52, 53]
    kv.check_invariants()


def test_decode_filled_block_keeps_the_extra_key() -> None:
    """A block filled by decode under an extra key (cache salt) chains off the salted blocks:
    only the same salt hits it.

    Mirrors vLLM v1 ``test_prefix_caching.py::test_cache_key_salting``: after 5 appended tokens
    fill the fourth block, its hash is the hash of the salted third block's hash and its tokens;
    a request with the same salt hits the cached blocks, one with another salt misses.
    """
    kv = manager(32, enable_kv_events=True)
    prompt = [i for i in range(3) for _ in range(BS)] + [3] * 11
    kv.add_sequence(0, prompt, extra_key="salt1")
    (prefill,) = stored(kv.take_events())
    kv.append_tokens(0, [8] * 5)
    (filled,) = stored(kv.take_events())
    assert filled.parent_block_hash == prefill.block_hashes[-1]
    assert filled.extra_keys == [(b"salt1",)]
    grown = prompt + [8] * 5 + [1]
    assert kv.add_sequence(1, grown, extra_key="salt1") == 4 * BS
    assert table(kv, 1)[:4] == table(kv, 0)
    assert kv.add_sequence(2, grown, extra_key="salt2") == 0
    assert kv.add_sequence(3, grown) == 0
    kv.check_invariants()
