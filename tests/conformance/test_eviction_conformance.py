"""Eviction conformance: which cached blocks go when some must, as TGI v3 asserts for its radix
trie (facts carried over, not code). Conventions and deliberate differences:
docs/conformance.md.
"""

from __future__ import annotations

from conformance_helpers import evict_cached, manager, removed_hashes, stored, table

BS = 2  # one TGI token is one pagedkv block of 2 tokens: a trailing token is a partial block


def tokens(*names: int) -> list[int]:
    return [x for name in names for x in (10 * name, 10 * name + 1)]


def test_least_recently_used_leaves_go_first_and_hits_refresh() -> None:
    """Evicting ``k`` cached blocks takes the tails of the least recently used chains, leaf
    first, and leaves the rest of each chain hittable; a hit refreshes every block it touches.

    Mirrors TGI v3 ``backends/v3/src/radix.rs::trie_evict_removes_correct_blocks``: with
    ``[0, 1, 2]``, ``[0, 1, 2, 3, 5, 6, 7]``, ``[0, 1, 2, 3, 4]`` and ``[1, 2, 3]`` inserted,
    evicting 1 removes ``7``; after refreshing the other leaves, evicting 2 removes ``5, 6``;
    after refreshing ``[0, 1, 2, 3]`` and ``[1, 2, 3]``, evicting 3 removes ``4, 3, 2``; a
    final eviction removes ``[1, 2, 3]``'s blocks, then ``0, 1``. TGI's trie finds without
    allocating; here a lookup is a request of the cached chain plus one token, which lands in a
    partial block that is never cached. TGI lists a trie node's blocks head first; pagedkv
    evicts a chain tail first.
    """
    kv = manager(12, block_size=BS, enable_kv_events=True)
    chains = {"A": (0, 1, 2), "B": (0, 1, 2, 3, 5, 6, 7), "C": (0, 1, 2, 3, 4), "D": (1, 2, 3)}
    name = {}  # physical block -> TGI's label (D's blocks are "d1", "d2", "d3")
    hashes = {}
    for seq, (chain, labels) in enumerate(chains.items()):
        kv.add_sequence(seq, tokens(*labels))
        (event,) = stored(kv.take_events())
        new = table(kv, seq)[len(table(kv, seq)) - len(event.block_hashes) :]
        for block, label, h in zip(new, labels[len(labels) - len(new) :], event.block_hashes, strict=True):
            name[block] = f"d{label}" if chain == "D" else str(label)
            hashes[name[block]] = h
        kv.free(seq)
    assert kv.stats()["num_cached_blocks"] == 11

    step = iter(range(100, 200))

    def lookup(*labels: int) -> int:
        seq = next(step)
        hit = kv.add_sequence(seq, tokens(*labels) + [7777])
        kv.free(seq)
        assert kv.take_events() == []  # a lookup stores nothing
        return hit // BS

    def evict(count: int) -> list[str]:
        evicted = [name[b] for b in evict_cached(kv, count, next(step))]
        assert removed_hashes(kv.take_events()) == [hashes[n] for n in evicted]
        return evicted

    assert evict(1) == ["7"]
    assert lookup(0, 1, 2, 3, 5, 6) == 6  # the rest of the chain is still there
    assert lookup(0, 1, 2, 3, 4) == 5  # refresh the other leaves
    assert lookup(1, 2, 3) == 3
    assert evict(2) == ["6", "5"]
    assert lookup(0, 1, 2, 3) == 4
    assert lookup(1, 2, 3) == 3
    assert evict(3) == ["4", "3", "2"]
    assert lookup(0, 1) == 2
    assert evict(int(kv.stats()["num_cached_blocks"])) == ["d3", "d2", "d1", "1", "0"]
    assert kv.stats()["num_cached_blocks"] == 0
    kv.check_invariants()
