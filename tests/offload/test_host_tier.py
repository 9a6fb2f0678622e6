"""The host cache through the bindings: ``KvCacheManager(..., num_host_cache_blocks=N)``,
``take_offload_ops`` / ``take_load_ops``, ``prefix_block_hashes``, hostile arguments, and a
randomized run that moves real K/V arrays and checks every hit returns the K/V computed for its
tokens."""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np
import pagedkv
import pytest


def _manager(num_blocks: int = 2, num_offload: int = 4, **kw: object) -> pagedkv.KvCacheManager:
    return pagedkv.KvCacheManager(num_blocks, 2, True, num_host_cache_blocks=num_offload, **kw)


def test_off_by_default():
    kv = pagedkv.KvCacheManager(4, 2, True)
    assert kv.num_host_cache_blocks == 0
    assert kv.take_offload_ops().shape == (0, 2)
    assert kv.take_load_ops().shape == (0, 2)
    assert kv.stats()["num_offload_blocks"] == 0


def test_an_evicted_block_comes_back_from_the_host():
    kv = _manager(enable_kv_events=True)
    kv.add_sequence(1, [1, 2, 3])
    kv.free(1)
    kv.add_sequence(2, [7, 8, 9, 10])
    offloads = kv.take_offload_ops()
    assert offloads.dtype == np.int32 and offloads.tolist() == [[0, 0]]
    kv.free(2)
    assert kv.match_prefix([1, 2, 5]) == 2
    assert kv.add_sequence(3, [1, 2, 5]) == 2
    loads = kv.take_load_ops()
    assert loads.dtype == np.int32
    assert loads.tolist() == [[0, int(kv.block_table(3)[0])]]
    stats = kv.stats()
    assert (stats["blocks_offloaded"], stats["blocks_loaded"]) == (3, 1)
    assert stats["prefix_hit_tokens"] == 2
    mediums = {(type(e).__name__, e.medium) for e in kv.take_events()}
    assert ("BlockStored", "CPU") in mediums and ("BlockStored", "GPU") in mediums
    kv.check_invariants()


def test_prefix_block_hashes_key_the_events():
    kv = pagedkv.KvCacheManager(8, 2, True, enable_kv_events=True)
    hashes = kv.prefix_block_hashes([1, 2, 3, 4, 5], extra_key="tenant")
    assert len(hashes) == 2 and all(isinstance(h, int) and 0 <= h < 2**128 for h in hashes)
    assert hashes != kv.prefix_block_hashes([1, 2, 3, 4, 5])
    assert kv.prefix_block_hashes(np.array([1, 2, 3, 4, 5]), extra_key="tenant") == hashes
    kv.add_sequence(1, [1, 2, 3, 4, 5], extra_key="tenant")
    (stored,) = kv.take_events()
    assert list(stored.block_hashes) == hashes
    # Without prefix caching: the same hasher and seed.
    assert pagedkv.KvCacheManager(8, 2).prefix_block_hashes([1, 2, 3, 4, 5], extra_key="tenant") == hashes


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_host_cache_blocks": -1},
        {"num_host_cache_blocks": 1.5},
        {"num_host_cache_blocks": True},
        {"num_host_cache_blocks": "3"},
        {"num_host_cache_blocks": 2**40},
        {"num_host_cache_blocks": 2**64},
        {"num_host_cache_blocks": 4, "enable_prefix_caching": False},
    ],
)
def test_hostile_configs_are_typed_errors(kwargs):
    args = {"num_blocks": 4, "block_size": 2, "enable_prefix_caching": True, **kwargs}
    with pytest.raises(pagedkv.PagedKvError):
        pagedkv.KvCacheManager(**args)


@pytest.mark.parametrize("tokens", [None, "abc", [1.5], [-1], [2**40], object()])
def test_hostile_prefix_block_hashes_inputs(tokens):
    kv = _manager()
    with pytest.raises(pagedkv.PagedKvError):
        kv.prefix_block_hashes(tokens)
    kv.check_invariants()


def _fingerprints(tokens: list[int], salt: int) -> np.ndarray:
    """Per token, a value determined by the salt and every token up to it (the "K/V")."""
    out = np.empty(len(tokens), np.float64)
    h = salt * 1_000_003 + 7
    for i, t in enumerate(tokens):
        h = (h * 31 + t + 1) % (2**61 - 1)
        out[i] = h
    return out


_PROMPT_BASES = [list(range(1, 16)), list(range(1, 5)) + list(range(50, 61)), list(range(90, 105))]


class _HostHitLoop:
    """Random admissions and frees over a tiny pool and a tinier host tier, shared by the
    host-hit tests. The data plane runs each admission's ops in the documented order (offloads,
    copies, loads) on real arrays; the caller then writes the tokens no tier served (the pass)
    and checks what every live sequence holds."""

    def __init__(self, kv: pagedkv.KvCacheManager, seed: int, num_blocks: int, num_host: int, bs: int):
        self.kv, self.rng = kv, random.Random(seed)
        self.device = np.full((num_blocks, bs), np.nan)
        self.host = np.full((num_host, bs), np.nan)
        self.live: dict[int, tuple[list[int], int]] = {}  # seq -> (tokens, salt)
        self.host_hits = 0

    def admissions(self, steps: int, *, salted: bool) -> Iterator[tuple[int, list[int], int, int]]:
        """Yields (seq, tokens, salt, hit) for each admission that fit, after its data ops ran;
        frees a random live sequence on about 45 % of the steps."""
        kv, rng = self.kv, self.rng
        for step in range(steps):
            if self.live and rng.random() < 0.45:
                victim = rng.choice(sorted(self.live))
                del self.live[victim]
                kv.free(victim)
                continue
            seq = step + 1000
            tokens = rng.choice(_PROMPT_BASES)[: rng.randint(1, 15)]
            salt = rng.randint(0, 1) if salted else 0
            expected = kv.match_prefix(tokens, extra_key=salt)
            try:
                hit = kv.add_sequence(seq, tokens, extra_key=salt)
            except pagedkv.OutOfBlocksError:
                continue
            assert hit == expected
            for d, h in kv.take_offload_ops():
                self.host[h] = self.device[d]
            for s, d in kv.take_copy_ops():
                self.device[d] = self.device[s]
            loads = kv.take_load_ops()
            self.host_hits += len(loads)
            for h, d in loads:
                self.device[d] = self.host[h]
            self.live[seq] = (tokens, salt)
            yield seq, tokens, salt, hit
        assert self.host_hits > 0, "the run never hit the host tier: it checked nothing about it"


@pytest.mark.parametrize("seed", range(6))
def test_hits_from_the_host_return_the_kv_computed_for_their_tokens(seed):
    """Every computed token must hold its own K/V (salted by the request's extra key)."""
    bs, num_blocks, num_host = 2, 9, 3
    kv = pagedkv.KvCacheManager(num_blocks, bs, True, num_host_cache_blocks=num_host)
    loop = _HostHitLoop(kv, seed, num_blocks, num_host, bs)
    device = loop.device
    for seq, tokens, salt, hit in loop.admissions(120, salted=True):
        table = kv.block_table(seq)
        want = _fingerprints(tokens, salt)
        for p in range(hit, len(tokens)):  # the pass
            device[table[p // bs], p % bs] = want[p]
        for other, (toks, s) in loop.live.items():
            t = kv.block_table(other)
            got = np.array([device[t[p // bs], p % bs] for p in range(len(toks))])
            np.testing.assert_array_equal(got, _fingerprints(toks, s), err_msg=f"sequence {other}")
        kv.check_invariants()


def test_offload_block_hash_names_what_each_host_block_holds():
    kv = _manager()
    kv.add_sequence(1, [1, 2, 3])
    kv.free(1)
    kv.add_sequence(2, [7, 8, 9, 10])
    assert kv.take_offload_ops().tolist() == [[0, 0]]
    assert kv.offload_block_hash(0) == kv.prefix_block_hashes([1, 2])[0]
    assert kv.offload_block_hash(1) is None
    for bad in (-1, 4, 2**40, 1.0, "0", None, True):
        with pytest.raises(pagedkv.PagedKvError):
            kv.offload_block_hash(bad)
    with pytest.raises(pagedkv.PagedKvError):
        pagedkv.KvCacheManager(4, 2, True).offload_block_hash(0)  # no tier
    kv.check_invariants()


@pytest.mark.parametrize("seed", range(4))
def test_host_hits_with_kv_groups_return_each_group_s_kv(seed):
    """The host cache under a manager of two KV groups (full attention and a 4-token window on
    one pool, one host tier: every feature works for any group count). Each group's "K/V" is
    salted with its group, so a block loaded into the wrong group, or a host block holding
    another group's content, fails; every position a table still holds must hold its own K/V."""
    bs, num_blocks, num_host = 2, 24, 4
    groups = [pagedkv.FullAttention(), pagedkv.SlidingWindow(window=4)]
    kv = pagedkv.KvCacheManager(
        num_blocks, bs, True, num_host_cache_blocks=num_host, kv_groups=groups, enable_kv_events=True
    )
    loop = _HostHitLoop(kv, seed, num_blocks, num_host, bs)
    device = loop.device
    group_events: set[int | None] = set()
    for seq, tokens, _salt, hit in loop.admissions(150, salted=False):
        for g in range(len(groups)):  # the pass writes what no tier served, in every group
            table = kv.block_table(seq, group=g)
            want = _fingerprints(tokens, 7 + g)
            for p in range(hit, len(tokens)):
                if table[p // bs] >= 0:
                    device[table[p // bs], p % bs] = want[p]
        for other, (toks, _) in loop.live.items():
            for g in range(len(groups)):
                t = kv.block_table(other, group=g)
                want = _fingerprints(toks, 7 + g)
                held = [p for p in range(len(toks)) if t[p // bs] >= 0]
                if g == 0:
                    assert len(held) == len(toks)  # full attention releases nothing
                # the window's tokens are always held
                assert all(p in held for p in range(max(0, len(toks) - 4), len(toks)))
                got = np.array([device[t[p // bs], p % bs] for p in held])
                np.testing.assert_array_equal(got, want[held], err_msg=f"sequence {other} group {g}")
        group_events.update(getattr(e, "group_idx", None) for e in kv.take_events())
        kv.check_invariants()
    assert {0, 1} <= group_events, group_events


def test_num_offload_blocks_is_the_deprecated_name_of_num_host_cache_blocks():
    with pytest.warns(DeprecationWarning, match="num_host_cache_blocks"):
        kv = pagedkv.KvCacheManager(4, 2, True, num_offload_blocks=3)
    assert kv.num_host_cache_blocks == kv.num_offload_blocks == kv.stats()["num_offload_blocks"] == 3
    with pytest.warns(DeprecationWarning), pytest.raises(pagedkv.InvalidArgumentError, match="disagrees"):
        pagedkv.KvCacheManager(4, 2, True, num_offload_blocks=3, num_host_cache_blocks=2)
