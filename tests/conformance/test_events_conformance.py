"""KV-event conformance: which events the allocator records, how many and with which fields,
as vLLM v1 and SGLang assert in their allocator tests (facts carried over, not code).
Conventions and deliberate differences: docs/conformance.md.
"""

from __future__ import annotations

import pagedkv
import pytest
from conformance_helpers import BS, manager, removed_hashes, stored


@pytest.mark.parametrize("num_blocks", [2, 3, 10])
def test_store_evict_clear_counts(num_blocks: int) -> None:
    """A prompt of ``n`` full blocks records one ``BlockStored`` with ``n`` hashes and
    ``n * block_size`` token ids, and draining empties the queue; after a free, a miss that needs
    every block records ``n`` ``BlockRemoved`` (one per block, each a stored hash) and then one
    ``BlockStored``: ``n + 1`` events. Reset records ``AllBlocksCleared``.

    Mirrors vLLM v1 ``tests/v1/core/test_prefix_caching.py::test_kv_cache_events``
    (``blocks_to_cache`` 2, 3, 10, a pool of exactly that many blocks). vLLM's second request has
    the same tokens but skips the lookup; pagedkv always looks up, so the second prompt differs.
    """
    kv = manager(num_blocks, enable_kv_events=True)
    kv.add_sequence(0, list(range(num_blocks * BS)))
    events = kv.take_events()
    assert len(events) == 1
    (first,) = stored(events)
    assert len(first.block_hashes) == num_blocks == kv.stats()["num_blocks_in_use"]
    assert len(first.token_ids) == first.block_size * len(first.block_hashes)
    assert first.block_size == BS
    assert kv.take_events() == []

    kv.free(0)
    kv.add_sequence(1, [10_000 + i for i in range(num_blocks * BS)])
    events = kv.take_events()
    assert len(events) == num_blocks + 1
    assert all(isinstance(e, pagedkv.BlockRemoved) and len(e.block_hashes) == 1 for e in events[:-1])
    assert removed_hashes(events) == first.block_hashes[::-1]  # tail first
    (second,) = stored(events[-1:])
    assert len(second.block_hashes) == num_blocks
    assert not set(second.block_hashes) & set(first.block_hashes)

    kv.free(1)
    assert kv.reset_prefix_cache() is True
    assert kv.take_events() == [pagedkv.AllBlocksCleared()]
    assert kv.stats()["num_cached_blocks"] == 0


@pytest.mark.parametrize("num_blocks", [2, 3, 10])
def test_extra_key_event_fields(num_blocks: int) -> None:
    """A request's namespace shows in its ``BlockStored``: with an extra key (pagedkv's
    namespace for adapters, salts and the like) every stored block carries it in
    ``extra_keys``; without one ``extra_keys`` is ``None``. ``lora_id`` and ``lora_name`` stay
    ``None`` (pagedkv has no LoRA ids) and ``block_size`` is the manager's.

    Mirrors vLLM v1 ``test_prefix_caching.py::test_kv_cache_events_with_lora`` (``lora_id`` 42
    with a LoRA request, ``None`` without, ``block_size`` and the hash count checked for 2, 3
    and 10 blocks). A deliberate difference: docs/conformance.md, "Adapters and salts in events".
    """
    kv = manager(num_blocks, enable_kv_events=True)
    prompt = list(range(num_blocks * BS))
    kv.add_sequence(0, prompt, extra_key=42)
    (keyed,) = stored(kv.take_events())
    assert len(keyed.block_hashes) == num_blocks
    assert keyed.block_size == BS
    assert keyed.extra_keys == [(b"42",)] * num_blocks
    assert keyed.lora_id is None and keyed.lora_name is None
    kv.free(0)

    # The same tokens without the key are another namespace: a miss that evicts every block.
    assert kv.add_sequence(1, prompt) == 0
    events = kv.take_events()
    assert removed_hashes(events) == keyed.block_hashes[::-1]
    plain = events[-1]
    assert isinstance(plain, pagedkv.BlockStored)
    assert len(plain.block_hashes) == num_blocks
    assert plain.block_size == BS
    assert plain.extra_keys is None and plain.lora_id is None
    assert not set(plain.block_hashes) & set(keyed.block_hashes)


def test_every_block_hash_depends_on_the_salt() -> None:
    """The same prompt under two salts and under none stores three chains with no hash in
    common: the salt changes every block's hash, not only the first one's.

    Mirrors vLLM v1 ``test_prefix_caching.py::test_cache_key_salting``: the salt enters the
    first block's hash and every later block's hash chains over it (``block_hashes[1]`` is the
    hash of ``block_hashes[0]`` and the tokens), so two salts give two different chains. pagedkv
    mixes the extra key into every block's hash (docs/conformance.md, "Adapters and salts in
    events"); the chains differ in the same way.
    """
    kv = manager(32, enable_kv_events=True)
    prompt = [i for i in range(3) for _ in range(BS)] + [3] * 11
    chains = {}
    for seq, salt in enumerate(("salt1", "salt2", None)):
        assert kv.add_sequence(seq, prompt, extra_key=salt) == 0
        (event,) = stored(kv.take_events())
        assert event.parent_block_hash is None
        assert list(event.token_ids) == prompt[: 3 * BS]
        assert event.extra_keys == (None if salt is None else [(salt.encode(),)] * 3)
        chains[salt] = event.block_hashes
    all_hashes = [h for hashes in chains.values() for h in hashes]
    assert len(all_hashes) == 9 and len(set(all_hashes)) == 9
    kv.check_invariants()


def test_reset_clears_without_removals_and_recomputes_the_same_hashes() -> None:
    """Reset records exactly one ``AllBlocksCleared`` and no ``BlockRemoved``; the cleared
    blocks have no hash left, so reusing them records no ``BlockRemoved`` either. The same
    content stored again gets the same hashes as before the reset.

    Mirrors vLLM v1 ``test_prefix_caching.py::test_reset_prefix_cache`` (after a reset no
    block has a hash), ``::test_kv_cache_events`` (the reset's event is ``AllBlocksCleared``),
    ``::test_hash_block_correct_reuse`` (a reused block's old hash is gone) and ``::test_prefill``
    (a block's hash is a function of its parent's hash and its tokens).
    """
    kv = manager(4, enable_kv_events=True)
    prompt = list(range(4 * BS))
    kv.add_sequence(0, prompt)
    (before,) = stored(kv.take_events())
    kv.free(0)
    assert kv.reset_prefix_cache() is True
    assert kv.take_events() == [pagedkv.AllBlocksCleared()]

    kv.add_sequence(1, [500 + i for i in range(4 * BS)])  # reuses all 4 blocks
    events = kv.take_events()
    assert [type(e) for e in events] == [pagedkv.BlockStored]
    kv.free(1)
    assert kv.reset_prefix_cache() is True
    assert kv.take_events() == [pagedkv.AllBlocksCleared()]

    assert kv.add_sequence(2, prompt) == 0
    (after,) = stored(kv.take_events())
    assert after.block_hashes == before.block_hashes
    assert after.parent_block_hash is None
    kv.check_invariants()


@pytest.mark.parametrize("block_size", [1, 2])
def test_one_stored_event_per_caching_call_for_several_page_sizes(block_size: int) -> None:
    """Inserting ``[1, 2, 3, 4, 5]`` stores every full page, reported in one ``BlockStored``
    whose ``token_ids`` are the pages' tokens in order, ``block_size`` apiece.

    Mirrors SGLang ``test/srt/test_radix_cache_unit.py::TestRadixCache::test_kv_cache_events``
    (page sizes 1 and 2: the insert records ``BlockStored`` events, each with at most
    ``page_size`` token ids). SGLang records one event per page; pagedkv, like vLLM, one per
    caching call (docs/conformance.md, "One event per caching call").
    """
    kv = manager(8, block_size=block_size, enable_kv_events=True)
    tokens = [1, 2, 3, 4, 5]
    kv.add_sequence(0, tokens)
    events = kv.take_events()
    assert len(events) == 1
    (event,) = stored(events)
    full = len(tokens) // block_size
    assert len(event.block_hashes) == full
    assert event.block_size == block_size
    assert list(event.token_ids) == tokens[: full * block_size]
