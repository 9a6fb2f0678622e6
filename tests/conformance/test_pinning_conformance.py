"""Pinning conformance: a pinned prefix moves its blocks from evictable to protected until it
is unpinned, and nests, as SGLang's radix cache does with ``inc_lock_ref`` /
``dec_lock_ref`` (facts carried over, not code). Conventions: docs/conformance.md.
"""

from __future__ import annotations

import pagedkv
import pytest
from conformance_helpers import manager


def test_pins_protect_blocks_from_eviction_and_nest() -> None:
    """Pinning a cached 2-block prefix takes its blocks out of the evictable set
    (``num_cached_blocks`` 2 -> 0, ``num_blocks_in_use`` 0 -> 2); a second pin nests; the
    first unpin keeps them protected, the second makes them evictable again; unpinning more
    than was pinned is an error.

    Mirrors SGLang ``test/srt/test_radix_cache_unit.py::TestRadixCache::test_lock_ref_operations``
    (``inc_lock_ref`` moves a node's size from evictable to protected, ``dec_lock_ref`` back).
    """
    kv = manager(4, 4)
    prefix = list(range(8))
    kv.add_sequence(0, prefix)
    kv.free(0)
    assert (kv.stats()["num_cached_blocks"], kv.stats()["num_blocks_in_use"]) == (2, 0)
    assert kv.pin_prefix(prefix) == 8
    assert kv.pin_prefix(prefix) == 8
    stats = kv.stats()
    assert (stats["num_cached_blocks"], stats["num_blocks_in_use"], stats["num_pinned_blocks"]) == (0, 2, 2)
    with pytest.raises(pagedkv.OutOfBlocksError):
        kv.add_sequence(1, num_tokens=16)  # the pinned blocks are not evictable
    kv.unpin_prefix(prefix)
    assert kv.stats()["num_cached_blocks"] == 0
    kv.unpin_prefix(prefix)
    assert (kv.stats()["num_cached_blocks"], kv.stats()["num_pinned_blocks"]) == (2, 0)
    with pytest.raises(pagedkv.InvalidArgumentError):
        kv.unpin_prefix(prefix)
    kv.add_sequence(1, num_tokens=16)  # evictable again
    kv.check_invariants()


def test_reset_refuses_while_a_prefix_is_pinned() -> None:
    """``reset_prefix_cache`` fails while any block is in use, pinned ones included.

    Mirrors vLLM v1 ``tests/v1/core/test_prefix_caching.py::test_reset_prefix_cache``
    (refused while blocks are in use).
    """
    kv = manager(4, 4)
    kv.add_sequence(0, list(range(5)))
    kv.free(0)
    kv.pin_prefix(list(range(4)))
    assert not kv.reset_prefix_cache()
    kv.unpin_prefix(list(range(4)))
    assert kv.reset_prefix_cache()
