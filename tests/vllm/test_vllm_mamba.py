"""The state-group hit (a Mamba group's, in vLLM's ``"align"`` mode) on pagedkv's index:
``KvCacheManager.longest_cached_block`` against vLLM's ``MambaManager.find_longest_cache_hit``
(docs/design.md, KV groups, "State hits"; docs/integrations/vllm.md, Mamba).

The look-up alone, on the core: the rightmost block whose hash is cached, one block, not a
chain (the manager's Mamba path, which uses it, is compared in
test_vllm_mamba_differential.py). Both managers run the same full-attention requests
(admissions with hits, frees, ``evict_blocks`` of chosen positions, which leaves cached blocks
after an evicted one), and after
every call vLLM's Mamba hit finder, run on vLLM's block pool, and pagedkv's core, on its index,
answer every probe alike: the hit's length, and a block the index holds under the hash that ends
it. The two pools hold the same contents here: no pressure evicts (so no cached-evictable block
is chosen differently) and no admission computes content that is cached (no second copy in
vLLM, docs/conformance.md, Duplicate copies): gaps are made only after the last admission.
Runs in the vLLM stage (scripts/vllm/stage.sh); skipped elsewhere.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from vllm_test_inputs import admit_alike, both_managers, prompt_request

# Imported inside the tests; the folder's conftest.py skips them where these do not import.
NEEDS_VLLM = ("pagedkv.integrations.vllm", "vllm.v1.core.single_type_kv_cache_manager")

BS = 4
NUM_BLOCKS = 96  # room for every admission below: nothing is evicted by pressure
SEEDS = range(24)


class _Pair:
    """vLLM's manager and pagedkv's on one full-attention config, driven by the same calls."""

    def __init__(self) -> None:
        import torch
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

        init_none_hash(sha256)
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
        config = KVCacheConfig(
            num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)]
        )
        args: dict[str, Any] = dict(max_model_len=256, scheduler_block_size=BS, hash_block_size=BS)
        self.m = both_managers(config, enable_caching=True, **args)
        self.mamba = MambaSpec(
            block_size=BS, shapes=((1, 1),), dtypes=(torch.float32,), mamba_cache_mode="align"
        )
        self.hasher = get_request_block_hasher(BS, sha256)
        self.running: dict[str, dict[str, Any]] = {}
        self.probes = 0
        self.past_chain = 0  # probes whose state hit lies past the full-attention chain's

    def request(self, rid: str, prompt: list[int]) -> Any:
        return prompt_request(rid, prompt, self.hasher)

    def admit(self, rid: str, prompt: list[int]) -> None:
        self.running[rid] = admit_alike(self.m, rid, prompt, self.hasher)

    def free(self, rid: str) -> None:
        for kind, r in self.running.pop(rid).items():
            self.m[kind].free(r)

    def evict(self, rid: str, positions: set[int]) -> None:
        """``evict_blocks`` of the blocks at ``positions`` of running ``rid``'s table, each
        manager its own ids (the pools number blocks alike only until some are freed)."""
        for m in self.m.values():
            ids = m.get_block_ids(rid)[0]
            m.evict_blocks({ids[p] for p in positions})

    def probe(self, prompt: list[int], max_length: int) -> int:
        """Both state hits of ``prompt`` within ``max_length`` tokens; they must agree."""
        from vllm.v1.core.single_type_kv_cache_manager import MambaManager

        vllm = self.m["vllm"]
        r = self.request("probe", prompt)
        blocks, vllm_hit = MambaManager.find_longest_cache_hit(
            block_hashes=r.block_hashes,
            max_length=max_length,
            kv_cache_group_ids=[0],
            block_pool=vllm.block_pool,
            kv_cache_spec=self.mamba,
            drop_eagle_block=False,
            alignment_tokens=BS,
        )
        core = self.m["pagedkv"]._core
        got = core.longest_cached_block(r.block_hashes, max_length // BS)
        pagedkv_hit = 0 if got is None else got[0] * BS
        assert pagedkv_hit == vllm_hit, (prompt, max_length)
        if got is not None:
            n, block = got
            # vLLM's answer: nulls up to the hit's block, then the block cached under its hash.
            assert [b.is_null for b in blocks[0]] == [True] * (n - 1) + [False]
            assert core.cached_block(r.block_hashes[n - 1]) == block
        chain = vllm.get_computed_blocks(self.request("chain", prompt), max_length)[1]
        self.probes += 1
        self.past_chain += vllm_hit > chain
        return vllm_hit

    def check(self) -> None:
        self.m["pagedkv"].check_invariants()
        free = {kind: m.block_pool.get_num_free_blocks() for kind, m in self.m.items()}
        assert free["vllm"] == free["pagedkv"]


def _family(rng: random.Random) -> list[list[int]]:
    """Prompts sharing prefixes of a common base (whole blocks), each with a partial last block
    (so a full hit never recomputes a cached block: no second copies)."""
    base = [rng.randrange(1, 1000) for _ in range(8 * BS)]
    prompts = []
    for _ in range(6):
        shared = rng.randrange(0, 8) * BS
        tail = [rng.randrange(1000, 2000) for _ in range(rng.randrange(0, 4) * BS + rng.randrange(1, BS))]
        prompts.append(base[:shared] + tail)
    return prompts


def _probe_all(pair: _Pair, prompts: list[list[int]], rng: random.Random) -> None:
    # Bounds up to the prompt's last token, as vLLM's callers pass (its finder reads a hash
    # past the list for a longer one, an IndexError; pagedkv's stops at the list).
    for p in prompts:
        for max_length in (len(p) - 1, rng.randrange(0, len(p))):
            pair.probe(p, max_length)
    pair.check()


@pytest.mark.parametrize("seed", SEEDS)
def test_state_hit_matches_vllms_mamba_finder(seed: int) -> None:
    """Random admissions and frees of prompts sharing prefixes, then gaps: random positions of
    running requests' tables evicted (blocks after them stay cached) and requests freed. Every
    probe of every prompt, at the prompt's bound and a random one, gets vLLM's state hit."""
    rng = random.Random(seed)
    pair = _Pair()
    prompts = _family(rng)
    for step in range(10):
        if pair.running and rng.random() < 0.35:
            pair.free(rng.choice(sorted(pair.running)))
        else:
            pair.admit(f"r{step}", rng.choice(prompts))
        _probe_all(pair, prompts, rng)
    # Gaps: no admission after this point (it would compute content cached past a gap, a
    # second copy in vLLM), so both pools keep the same contents.
    for rid in sorted(pair.running):
        n = len(pair.m["vllm"].get_block_ids(rid)[0])
        positions = {p for p in range(n) if rng.random() < 0.4}
        pair.evict(rid, positions)
        _probe_all(pair, prompts, rng)
    for rid in sorted(pair.running):
        pair.free(rid)
        _probe_all(pair, prompts, rng)


def test_the_differential_reaches_hits_past_the_chain() -> None:
    """The seeds above reach what makes a state hit differ from a full-attention hit: a cached
    block after an evicted one (so a chain finder in its place fails them)."""
    past_chain = 0
    for seed in SEEDS[:8]:
        rng = random.Random(seed)
        pair = _Pair()
        prompts = _family(rng)
        for i, p in enumerate(prompts):
            pair.admit(f"r{i}", p)
        for rid in sorted(pair.running):
            n = len(pair.m["vllm"].get_block_ids(rid)[0])
            if n > 2:
                pair.evict(rid, {rng.randrange(0, n - 1)})
        _probe_all(pair, prompts, rng)
        past_chain += pair.past_chain
    assert past_chain > 0


def test_the_documented_case() -> None:
    """vLLM's test_hybrid_fa_deeper_hit_respects_connector_lookup_policy seeds four blocks and
    evicts the state blocks at 1, 2 and 3; here the cached blocks are full attention's, so
    evicting blocks 1 and 2 leaves 0 and 3: the state hit is 4 blocks, the chain's 1."""
    pair = _Pair()
    prompt = list(range(1, 4 * BS + 2))
    pair.admit("a", prompt)
    pair.evict("a", {1, 2})
    assert pair.probe(prompt, len(prompt) - 1) == 4 * BS
    assert pair.probe(prompt, 3 * BS) == BS
    assert pair.past_chain == 1
    pair.free("a")
    assert pair.probe(prompt, len(prompt) - 1) == 4 * BS
    pair.check()


def test_hostile_arguments_are_typed_errors() -> None:
    """A group the manager does not have, a hash of the wrong type or a negative bound: typed
    errors, nothing changed; an empty list or a bound of 0 is no hit; a bound past the list is
    the list."""
    from pagedkv.errors import InvalidArgumentError

    pair = _Pair()
    prompt = list(range(1, 3 * BS + 2))
    pair.admit("a", prompt)
    core = pair.m["pagedkv"]._core
    hashes = pair.request("p", prompt).block_hashes
    with pytest.raises(InvalidArgumentError):
        core.longest_cached_block(hashes, 3, group=1)
    with pytest.raises((TypeError, InvalidArgumentError)):
        core.longest_cached_block([hashes[0], "x"], 2)
    with pytest.raises(OverflowError):
        core.longest_cached_block(hashes, -1)
    assert core.longest_cached_block([], 5) is None
    assert core.longest_cached_block(hashes, 0) is None
    # A bad hash past the bound is never read.
    assert core.longest_cached_block([*hashes, "x"], 3) == core.longest_cached_block(hashes, 3)
    assert core.longest_cached_block(hashes, 10**6)[0] == 3
    core.check_invariants()
    pair.check()


def test_without_prefix_caching_there_is_no_hit() -> None:
    import pagedkv

    core = pagedkv.KvCacheManager(num_blocks=8, block_size=BS)
    core.add_sequence(1, list(range(3 * BS)))
    assert core.longest_cached_block([b"x" * 32] * 3, 3) is None


def _state_rule(trace: list[tuple[int, int]], hit_blocks: int = 0) -> list[list[int]]:
    """The live positions of one request's state table after each ``(computed, new)`` step, by
    the rule docs/integrations/vllm.md states for vLLM's align mode (no speculative blocks):
    at a step, first every position below ``(computed - 1) // block_size`` is released (a
    sliding window of 2 tokens' rule; vLLM also releases the state block of the step before
    last, ``last_state_block_idx``, which is always among those), then, when the table does not
    reach the step's end, the interior positions are padded null and one block is allocated at
    the last position: one block per step whatever the chunk's length. A hit of ``k`` blocks
    starts the table as ``k - 1`` nulls and the hit's state block."""
    table = [i == hit_blocks - 1 for i in range(hit_blocks)]
    live_after = []
    for computed, new in trace:
        for i in range(min(max(computed - 1, 0) // BS, len(table))):
            table[i] = False
        required = -(-(computed + new) // BS)
        if required > len(table):
            table.extend([False] * (required - 1 - len(table)))
            table.append(True)
        live_after.append([i for i, live in enumerate(table) if live])
    return live_after


def _align_steps(m: Any, r: Any, rng: random.Random, decode_steps: int) -> tuple[list[tuple[int, int]], int]:
    """Runs ``r`` on vLLM's manager ``m`` from its prefix hit: random prefill chunks ending at
    block boundaries (as vLLM's scheduler splits them), but the prompt's last, then decode
    steps, checking the state table after each against ``_state_rule``. Returns the steps and
    the hit's blocks."""
    blocks, hit = m.get_computed_blocks(r)[:2]
    assert hit % BS == 0
    trace: list[tuple[int, int]] = []
    prompt_len = r.num_tokens
    while r.num_computed_tokens < prompt_len + decode_steps:
        c = r.num_computed_tokens or hit
        if c < prompt_len:
            n = min(rng.randrange(1, 4) * BS, prompt_len - c)
        else:
            n = 1
            r.append_output_token_ids(rng.randrange(1, 1000))
        m.new_step_starts()
        free = m.block_pool.get_num_free_blocks()
        first = not trace
        got = m.allocate_slots(r, n, hit if first else 0, blocks if first else None)
        assert got is not None
        trace.append((c, n))
        live = [i for i, b in enumerate(m.get_block_ids(r.request_id)[1]) if b != 0]
        assert live == _state_rule(trace, hit // BS)[-1], (hit, trace)
        # Full attention's new blocks plus at most one state block (and, at the hit, the hit's
        # cached blocks of both groups, taken off the free queue).
        fa_new = -(-(c + n) // BS) - -(-c // BS)
        revived = hit // BS + 1 if first and hit else 0
        assert free - m.block_pool.get_num_free_blocks() <= fa_new + 1 + revived
        r.num_computed_tokens = c + n
    return trace, hit // BS


@pytest.mark.parametrize("seed", range(12))
def test_vllms_align_tables_follow_the_documented_rule(seed: int) -> None:
    """What the core's state group kind must build (docs/integrations/vllm.md, Mamba, (1)):
    vLLM's align-mode Mamba table on a full-attention + Mamba config follows the documented
    rule step by step, null positions inside the table included (not a leading run, unlike a
    window group's): a request without a hit, then one whose prompt extends it, hitting the
    state block cached at the first one's deepest chunk boundary."""
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
    from vllm.v1.request import Request

    init_none_hash(sha256)
    rng = random.Random(seed)
    fa = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
    mamba = MambaSpec(block_size=BS, shapes=((1, 1),), dtypes=(torch.float32,), mamba_cache_mode="align")
    config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["fa"], fa), KVCacheGroupSpec(["mamba"], mamba)],
    )
    m = VllmKVCacheManager(
        config, max_model_len=256, enable_caching=True, scheduler_block_size=BS, hash_block_size=BS
    )
    hasher = get_request_block_hasher(BS, sha256)
    prompt = [rng.randrange(1, 1000) for _ in range(rng.randrange(2, 10) * BS + rng.randrange(1, BS))]
    first = Request("first", prompt, SamplingParams(max_tokens=64), None, block_hasher=hasher)
    assert _align_steps(m, first, rng, decode_steps=12)[1] == 0
    m.free(first)
    longer = [*prompt, *(rng.randrange(1, 1000) for _ in range(rng.randrange(1, 4) * BS + 1))]
    second = Request("second", longer, SamplingParams(max_tokens=64), None, block_hasher=hasher)
    trace, hit_blocks = _align_steps(m, second, rng, decode_steps=6)
    assert hit_blocks > 0, trace
