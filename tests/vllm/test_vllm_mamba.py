"""The state-group hit (a Mamba group's, in vLLM's ``"align"`` mode) on pagedkv's index:
``KvCacheManager.longest_cached_block`` against vLLM's ``MambaManager.find_longest_cache_hit``
(docs/design.md, KV groups, "State hits"; docs/integrations/vllm.md, Mamba).

Mamba groups stay refused by pagedkv's vLLM manager (tests/vllm/test_vllm_integration.py); this
is the first piece of them, the look-up: the rightmost block whose hash is cached, one block, not
a chain. Both managers run the same full-attention requests (admissions with hits, frees,
``evict_blocks`` of chosen positions, which leaves cached blocks after an evicted one), and after
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

# Imported inside the tests; the folder's conftest.py skips them where these do not import.
NEEDS_VLLM = ("pagedkv.integrations.vllm", "vllm.v1.core.single_type_kv_cache_manager")

BS = 4
NUM_BLOCKS = 96  # room for every admission below: nothing is evicted by pressure
SEEDS = range(24)


class _Pair:
    """vLLM's manager and pagedkv's on one full-attention config, driven by the same calls."""

    def __init__(self) -> None:
        import torch
        from pagedkv.integrations.vllm import KVCacheManager
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

        init_none_hash(sha256)
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
        config = KVCacheConfig(
            num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)]
        )
        args: dict[str, Any] = dict(max_model_len=256, scheduler_block_size=BS, hash_block_size=BS)
        self.m = {
            "vllm": VllmKVCacheManager(config, enable_caching=True, **args),
            "pagedkv": KVCacheManager(config, enable_caching=True, **args),
        }
        self.mamba = MambaSpec(
            block_size=BS, shapes=((1, 1),), dtypes=(torch.float32,), mamba_cache_mode="align"
        )
        self.hasher = get_request_block_hasher(BS, sha256)
        self.running: dict[str, dict[str, Any]] = {}
        self.probes = 0
        self.past_chain = 0  # probes whose state hit lies past the full-attention chain's

    def request(self, rid: str, prompt: list[int]) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        return Request(rid, prompt, SamplingParams(max_tokens=8), None, block_hasher=self.hasher)

    def admit(self, rid: str, prompt: list[int]) -> None:
        from vllm.v1.request import RequestStatus

        hits = {}
        self.running[rid] = {}
        for kind, m in self.m.items():
            r = self.request(rid, prompt)
            blocks, hit = m.get_computed_blocks(r)[:2]
            assert (
                m.allocate_slots(r, r.num_tokens - hit, hit, blocks, full_sequence_must_fit=True) is not None
            )
            r.status = RequestStatus.RUNNING
            r.num_computed_tokens = r.num_tokens
            self.running[rid][kind] = r
            hits[kind] = hit
        assert hits["vllm"] == hits["pagedkv"]

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


class _CorePair:
    """vLLM's manager on a full-attention + align-mode Mamba config and pagedkv's core with
    ``[FullAttention(), MambaState()]`` (the null block 0 reserved, as vLLM's), driven by the
    same scheduler steps: ``new_step_starts`` / ``new_step``, admissions of a block-aligned
    first chunk, running chunks and decode tokens, frees, preemptions and ``evict_blocks`` of
    state blocks. After every call both answer alike and hold alike: the admission's hit (or
    refusal), ``allocate_slots``' refusal, each group's live positions, the free blocks, and the
    block ids up to a renaming kept across the run (a bijection)."""

    def __init__(self, num_blocks: int) -> None:
        import pagedkv
        import torch
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

        init_none_hash(sha256)
        fa = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
        mamba = MambaSpec(block_size=BS, shapes=((1, 1),), dtypes=(torch.float32,), mamba_cache_mode="align")
        config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["fa"], fa), KVCacheGroupSpec(["mamba"], mamba)],
        )
        self.vllm = VllmKVCacheManager(
            config, max_model_len=256, enable_caching=True, scheduler_block_size=BS, hash_block_size=BS
        )
        self.core = pagedkv.KvCacheManager(
            num_blocks,
            BS,
            True,
            kv_groups=[pagedkv.FullAttention(), pagedkv.MambaState()],
            max_model_len=256,
            null_block=0,
        )
        self.hasher = get_request_block_hasher(BS, sha256)
        self.reqs: dict[str, Any] = {}
        self.seq: dict[str, int] = {}
        self.names: dict[int, int] = {}  # vLLM block id -> pagedkv block id, live blocks
        self.refused_this_step = 0
        self.next_seq = 0
        self.compared = 0  # calls compared before the schedules parted (if they did)
        self.interior_nulls = 0  # checks that saw a null state position after a live one
        self.preempted = 0
        # vLLM indexes every copy of a content (a request whose hit stops at a state block
        # recomputes full-attention blocks another holds), pagedkv one: from the first second
        # copy on, which block a hit revives may differ (docs/conformance.md, Duplicate copies),
        # so a run stops comparing there.
        self.parted = False
        self.hits = 0

    def step(self) -> None:
        self.vllm.new_step_starts()
        self.core.new_step()

    def admit(self, rid: str, prompt: list[int], chunk_blocks: int) -> bool:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request, RequestStatus

        r = Request(rid, prompt, SamplingParams(max_tokens=64), None, block_hasher=self.hasher)
        blocks, hit = self.vllm.get_computed_blocks(r)[:2]
        n = min(chunk_blocks * BS, len(prompt) - hit)
        got = self.vllm.allocate_slots(r, n, hit, blocks)
        seq = self.next_seq = self.next_seq + 1
        try:
            core_hit = self.core.add_sequence(
                seq, prompt, num_scheduled=n, reserve_prompt=False, require_full_prompt=False
            )
        except pagedkv_errors().OutOfBlocksError:
            core_hit = None
        assert (got is None) == (core_hit is None), (rid, hit, got)
        if got is None:
            # A refusal: the pool is short, or the hit's state was cached in this step.
            self.refused_this_step += hit > 0 and self.vllm.block_pool.get_num_free_blocks() > n
            self.check()
            return False
        assert core_hit == hit, (rid, hit, core_hit)
        self.hits += hit > 0
        r.status = RequestStatus.RUNNING
        r.num_computed_tokens = hit + n
        self.reqs[rid], self.seq[rid] = r, seq
        self.check()
        return True

    def run(self, rid: str, chunk_blocks: int, token: int) -> bool:
        """One step of a running request: the next block-aligned prefill chunk, or a decode token.
        A refusal preempts it (both managers free it)."""
        r, seq = self.reqs[rid], self.seq[rid]
        c = r.num_computed_tokens
        if c < r.num_prompt_tokens:
            n = min(chunk_blocks * BS, r.num_prompt_tokens - c)
        else:
            n = 1
            r.append_output_token_ids(token)
        got = self.vllm.allocate_slots(r, n)
        ok = self.core.allocate_slots(seq, n)
        assert (got is not None) == ok, (rid, c, n)
        if not ok:
            self.preempted += 1
            self.free(rid)
            return False
        if c >= r.num_prompt_tokens:
            self.core.provide_token_ids(seq, [token])
        r.num_computed_tokens = c + n
        self.check()
        return True

    def free(self, rid: str) -> None:
        self.vllm.free(self.reqs.pop(rid))
        self.core.free(self.seq.pop(rid))
        self.check()

    def evict_state(self, rid: str) -> None:
        """``evict_blocks`` of request ``rid``'s live state blocks, each manager its own ids."""
        ids = [b for b in self.vllm.get_block_ids(rid)[1] if b != 0]
        self.vllm.evict_blocks(set(ids))
        self.core.evict_blocks([self.names[b] for b in ids])
        self.check()

    def check(self) -> None:
        self.core.check_invariants()
        assert self.vllm.block_pool.get_num_free_blocks() == self.core.num_available_blocks
        # The live tables, block for block up to a renaming: one pagedkv block per vLLM block
        # and the reverse (so sharing between requests and groups is alike too).
        names: dict[int, int] = {}
        for rid in self.reqs:
            vllm_tables = self.vllm.get_block_ids(rid)
            for g in (0, 1):
                theirs = list(vllm_tables[g])
                ours = self.core.block_table(self.seq[rid], group=g).tolist()
                assert len(ours) == len(theirs), (rid, g, theirs, ours)
                for v, p in zip(theirs, ours, strict=True):
                    assert (v == 0) == (p == 0), (rid, g, theirs, ours)
                    assert names.setdefault(v, p) == p, (rid, g, theirs, ours)
        assert len(set(names.values())) == len(names), "not a bijection"
        self.names = names
        self.compared += 1
        for rid in self.reqs:
            live = [b != 0 for b in self.vllm.get_block_ids(rid)[1]]
            self.interior_nulls += any(a and not b for a, b in zip(live, live[1:], strict=False))
        index = self.vllm.block_pool.cached_block_hash_to_block._cache
        self.parted = any(isinstance(copies, dict) and len(copies) >= 2 for copies in index.values())


def pagedkv_errors() -> Any:
    import pagedkv

    return pagedkv


def _core_differential(seed: int, num_blocks: int, shared: bool) -> _CorePair:
    """Seeded steps on ``_CorePair``: prompts sharing prefixes of one base (``shared``) or each
    its own (no hit, so never a second copy: pressure, preemption and eviction compared to the
    end)."""
    rng = random.Random(seed)
    pair = _CorePair(num_blocks)
    base = [rng.randrange(1, 1000) for _ in range(10 * BS)]

    def prompt() -> list[int]:
        head = base[: rng.randrange(1, 10) * BS] if shared else []
        return head + [rng.randrange(1000, 2000) for _ in range(rng.randrange(1, 6 * BS))]

    prompts = [prompt() for _ in range(5)]
    # With shared prefixes, prefill goes block by block (a state at every boundary, so a hit
    # reaches the full-attention chain and nothing is computed twice until a state block is
    # evicted); with own prompts, chunks of 1 to 3 blocks (null positions inside the table).
    max_chunk = 2 if shared else 4
    next_id = 0
    for _ in range(40):
        pair.step()
        for rid in sorted(pair.reqs):
            if rid in pair.reqs and not pair.parted:
                pair.run(rid, rng.randrange(1, max_chunk), rng.randrange(1, 1000))
        for _ in range(rng.randrange(0, 3)):
            if not pair.parted:
                pair.admit(
                    f"r{next_id}", rng.choice(prompts) if shared else prompt(), rng.randrange(1, max_chunk)
                )
            next_id += 1
        if pair.reqs and rng.random() < 0.25 and not pair.parted:
            pair.free(rng.choice(sorted(pair.reqs)))
        if pair.reqs and rng.random() < (0.04 if shared else 0.15) and not pair.parted:
            pair.evict_state(rng.choice(sorted(pair.reqs)))
        if pair.parted:
            return pair
    for rid in sorted(pair.reqs):
        pair.free(rid)
    return pair


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("seed", range(12))
def test_the_core_state_group_matches_vllms_mamba_manager(seed: int, shared: bool) -> None:
    """pagedkv's core with a MambaState group against vLLM's manager on a full-attention +
    align-mode Mamba config: seeded steps of admissions (block-aligned first chunks, hits on
    state blocks, same-step refusals), running chunks and decode tokens, frees, preemptions and
    state-block evictions; answers, hits, live positions, free blocks and block ids alike after
    every call. Shared prefixes on a roomy pool (until vLLM holds a second copy of a content),
    own prompts on a tight one (pressure and preemption)."""
    _core_differential(seed, NUM_BLOCKS * 4 if shared else 40, shared)


def test_the_core_differential_reaches_what_it_checks() -> None:
    """The seeds above reach state hits, same-step refusals, interior nulls, preemptions, and
    compare many calls before the shared-prefix schedules part."""
    totals = dict(hits=0, refused=0, interior=0, preempted=0, compared=0)
    for seed in range(12):
        for shared in (True, False):
            pair = _core_differential(seed, NUM_BLOCKS * 4 if shared else 40, shared)
            totals["hits"] += pair.hits
            totals["refused"] += pair.refused_this_step
            totals["interior"] += pair.interior_nulls
            totals["preempted"] += pair.preempted
            totals["compared"] += pair.compared if shared else 0
    assert all(v > 0 for v in totals.values()), totals
    assert totals["compared"] > 12 * 50, totals
