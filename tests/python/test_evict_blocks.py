"""``KvCacheManager.evict_blocks`` through the bindings: index entries dropped by block id
(docs/design.md, Prefix caching), the events, and typed errors for bad ids that change
nothing. The core's model test (rust/pagedkv/tests/model.rs, ``Op::EvictBlocks``) covers the
state rules exhaustively; this checks the Python surface."""

from __future__ import annotations

import pagedkv
import pytest


def _kv() -> pagedkv.KvCacheManager:
    return pagedkv.KvCacheManager(
        num_blocks=8, block_size=2, enable_prefix_caching=True, enable_kv_events=True
    )


def test_held_blocks_stay_private_and_cached_ones_become_free() -> None:
    kv = _kv()
    kv.add_sequence(1, [1, 2, 3, 4, 5, 6])
    table = [int(b) for b in kv.block_table(1)]
    kv.take_events()
    assert kv.evict_blocks(iter(table[1:])) == 2  # any iterable; held blocks
    events = kv.take_events()
    assert [type(e) for e in events] == [pagedkv.BlockRemoved] * 2
    assert [int(b) for b in kv.block_table(1)] == table  # still held
    assert kv.match_prefix([1, 2, 3, 4, 5, 6, 0]) == 2
    kv.free(1)
    assert kv.stats()["num_cached_blocks"] == 1  # block 0 only: the others are free
    assert kv.evict_blocks([table[0], table[0], 0]) == 1  # cached; then nothing to drop
    assert kv.stats()["num_cached_blocks"] == 0 and kv.num_free_blocks == 8
    assert kv.match_prefix([1, 2, 3, 4, 5, 6, 0]) == 0
    kv.check_invariants()


@pytest.mark.parametrize("bad", [[0, 8], [0, -1], [0, 2**40], [0, 1.5], [0, "x"], "ab", 5])
def test_bad_ids_are_typed_and_change_nothing(bad: object) -> None:
    kv = _kv()
    kv.add_sequence(1, [1, 2, 3, 4, 5])
    kv.take_events()
    with pytest.raises(pagedkv.InvalidArgumentError):
        kv.evict_blocks(bad)  # type: ignore[arg-type]
    assert kv.take_events() == []
    assert kv.match_prefix([1, 2, 3, 4, 5]) == 4
    kv.check_invariants()


def test_a_pinned_block_is_refused() -> None:
    kv = _kv()
    kv.add_sequence(1, [1, 2, 3, 4, 5])
    table = [int(b) for b in kv.block_table(1)]
    kv.free(1)
    kv.pin_prefix([1, 2, 3, 4, 5])
    kv.take_events()
    with pytest.raises(pagedkv.InvalidArgumentError, match="pinned"):
        kv.evict_blocks([table[1], table[0]])
    assert kv.take_events() == []
    assert kv.match_prefix([1, 2, 3, 4, 5]) == 4
    kv.unpin_prefix([1, 2, 3, 4, 5])
    assert kv.evict_blocks([table[1], table[0]]) == 2
    kv.check_invariants()
