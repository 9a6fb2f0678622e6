"""Matching conformance: what a lookup matches, for several page sizes and extra keys, as
SGLang asserts in its radix-cache unit tests (facts carried over, not code).
Conventions and deliberate differences: docs/conformance.md.
"""

from __future__ import annotations

import pytest
from conformance_helpers import manager, table


@pytest.mark.parametrize(("page_size", "length"), [(1, 5), (2, 5), (4, 6)])
def test_a_cached_prompt_matches_whole_pages(page_size: int, length: int) -> None:
    """Looking up a cached prompt again matches a non-empty, page-aligned prefix: whole pages,
    at most ``len - 1`` tokens (the last prompt token is always recomputed).

    Mirrors SGLang ``test/srt/test_radix_cache_unit.py::TestRadixCache::test_page_alignment_boundary``
    (page sizes 1, 2, 4 with 5, 5, 6 tokens: the match is non-empty and a multiple of the page
    size). SGLang's ``match_prefix`` matches a fully cached key in full (its scheduler then
    recomputes the last token); pagedkv's admission serves ``len - 1`` tokens rounded down
    (docs/conformance.md, "Full-prompt hits").
    """
    kv = manager(16, block_size=page_size)
    tokens = list(range(length))
    kv.add_sequence(0, tokens)
    hit = kv.add_sequence(1, tokens)
    assert hit > 0 and hit % page_size == 0
    assert hit == (length - 1) // page_size * page_size
    assert table(kv, 1)[: hit // page_size] == table(kv, 0)[: hit // page_size]
    kv.check_invariants()


def test_each_extra_key_matches_only_its_own_blocks() -> None:
    """The same tokens inserted under two extra keys and under none are three separate entries:
    each key's lookup returns its own blocks, and an unknown key matches nothing.

    Mirrors SGLang ``test/srt/test_radix_cache_unit.py::TestRadixCache::test_extra_key_isolation``
    (page size 1, ``[1, 2, 3]`` under ``"key1"``, ``"key2"`` and ``None``; each match returns
    its own three values, ``"nonexistent"`` matches none).
    """
    kv = manager(32, block_size=1)
    keys = ("key1", "key2", None)
    for seq, key in enumerate(keys):
        assert kv.add_sequence(seq, [1, 2, 3], extra_key=key) == 0
    owned = {key: table(kv, seq) for seq, key in enumerate(keys)}
    assert len({b for blocks in owned.values() for b in blocks}) == 9  # no block shared

    for seq, key in enumerate(keys, start=10):
        assert kv.add_sequence(seq, [1, 2, 3, 4], extra_key=key) == 3
        assert table(kv, seq)[:3] == owned[key]
    assert kv.add_sequence(20, [1, 2, 3, 4], extra_key="nonexistent") == 0
    assert not set(table(kv, 20)) & {b for blocks in owned.values() for b in blocks}
    kv.check_invariants()
