"""Each KV-cache group's own prefix hit, the look-up vLLM's KV connectors make of a hybrid
coordinator (``find_longest_cache_hit_per_group``) and the scheduler's look-up for a connector
that restores lagging groups (``get_computed_blocks_for_connector``), on both managers call by
call (python/pagedkv/integrations/vllm/hybrid_hits.py; docs/integrations/vllm.md, KV connectors).

Both managers run the same requests (admissions with hits, frees, ``evict_blocks`` of chosen
positions of chosen groups, which leaves one group's blocks cached where another's are gone),
and after every call every probe of every prompt gets vLLM's answer: each group's hit length and
hit blocks (ids, the null block where vLLM's finder pads). The configs: full attention beside a
sliding window (of 2 tokens and of 3 blocks), beside a second full-attention group of another
spec (looked up on its own) and of the same spec (looked up together with the first: a block
counts only when both groups hold it). The two pools keep the same contents and block numbers:
every admission comes before the first gap and fits without evicting (as in
tests/vllm/test_vllm_mamba.py). The Mamba rule (the rightmost cached block) is checked against
vLLM's ``MambaManager`` finder on the same index. Runs in the vLLM stage (scripts/vllm/stage.sh);
skipped elsewhere.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from vllm_test_inputs import admit_alike, prompt_request

NEEDS_VLLM = ("pagedkv.integrations.vllm", "vllm.v1.core.kv_cache_coordinator")

BS = 4
NUM_BLOCKS = 160  # room for every admission below: nothing is evicted by pressure
SEEDS = range(16)
CONFIGS = ("window2", "window12", "full_other_spec", "full_same_spec")


def _config(name: str) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    shape: dict[str, Any] = dict(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
    second = {
        "window2": SlidingWindowSpec(**shape, sliding_window=2),
        "window12": SlidingWindowSpec(**shape, sliding_window=3 * BS),
        "full_other_spec": FullAttentionSpec(**{**shape, "num_kv_heads": 2}),
        "full_same_spec": FullAttentionSpec(**shape),
    }[name]
    groups = [KVCacheGroupSpec(["a"], FullAttentionSpec(**shape)), KVCacheGroupSpec(["b"], second)]
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)


class _Pair:
    """vLLM's manager and pagedkv's on one two-group config, driven by the same calls."""

    def __init__(self, config: str) -> None:
        from pagedkv.integrations.vllm import KVCacheManager
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        init_none_hash(sha256)
        args: dict[str, Any] = dict(
            max_model_len=512, scheduler_block_size=BS, hash_block_size=BS, enable_caching=True
        )
        self.m = {
            "vllm": VllmKVCacheManager(_config(config), **args),
            "pagedkv": KVCacheManager(_config(config), **args),
        }
        self.hasher = get_request_block_hasher(BS, sha256)
        self.running: dict[str, dict[str, Any]] = {}
        self.diverged = 0  # probes whose groups' hits differ

    def request(self, rid: str, prompt: list[int]) -> Any:
        return prompt_request(rid, prompt, self.hasher)

    def admit(self, rid: str, prompt: list[int]) -> None:
        self.running[rid] = admit_alike(self.m, rid, prompt, self.hasher)
        assert self.m["vllm"].get_block_ids(rid) == self.m["pagedkv"].get_block_ids(rid)

    def free(self, rid: str) -> None:
        for kind, r in self.running.pop(rid).items():
            self.m[kind].free(r)

    def evict(self, rid: str, positions: dict[int, set[int]]) -> None:
        """``evict_blocks`` of the blocks at ``positions[g]`` of running ``rid``'s group ``g``."""
        for m in self.m.values():
            ids = m.get_block_ids(rid)
            m.evict_blocks({ids[g][p] for g, ps in positions.items() for p in ps if ids[g][p] != 0})

    def probe(self, prompt: list[int], max_length: int) -> tuple[int, ...]:
        """Both managers' per-group hits of ``prompt`` within ``max_length`` tokens: equal."""
        answers = {}
        for kind, m in self.m.items():
            blocks, hits = m.coordinator.find_longest_cache_hit_per_group(
                self.request("probe", prompt).block_hashes, max_length
            )
            answers[kind] = ([[b.block_id for b in row] for row in blocks], hits)
        assert answers["vllm"] == answers["pagedkv"], (prompt, max_length)
        hits = answers["vllm"][1]
        self.diverged += len(set(hits)) > 1
        return hits

    def check(self) -> None:
        self.m["pagedkv"].check_invariants()
        free = {kind: m.block_pool.get_num_free_blocks() for kind, m in self.m.items()}
        assert free["vllm"] == free["pagedkv"]


def _family(rng: random.Random) -> list[list[int]]:
    """Prompts sharing prefixes of a common base (whole blocks), each with a partial last block
    (a full hit never recomputes a cached block: no second copies in vLLM's pool)."""
    base = [rng.randrange(1, 1000) for _ in range(8 * BS)]
    prompts = []
    for _ in range(6):
        shared = rng.randrange(0, 9) * BS
        tail = [rng.randrange(1000, 2000) for _ in range(rng.randrange(0, 4) * BS + rng.randrange(1, BS))]
        prompts.append(base[:shared] + tail)
    return prompts


def _probe_all(pair: _Pair, prompts: list[list[int]], rng: random.Random) -> None:
    for p in prompts:
        for max_length in (len(p) - 1, rng.randrange(0, len(p))):
            pair.probe(p, max_length)
    pair.check()


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("seed", SEEDS)
def test_per_group_hits_match_vllms(config: str, seed: int) -> None:
    """Random admissions and frees of prompts sharing prefixes, then gaps: random positions of
    random groups of running requests evicted, and the requests freed. Every probe, at the
    prompt's bound and a random one, gets vLLM's per-group hits, block for block."""
    rng = random.Random(seed)
    pair = _Pair(config)
    prompts = _family(rng)
    for step in range(8):
        if pair.running and rng.random() < 0.3:
            pair.free(rng.choice(sorted(pair.running)))
        else:
            pair.admit(f"r{step}", rng.choice(prompts))
        _probe_all(pair, prompts, rng)
    # Gaps, after the last admission (one would compute content cached past a gap: a second
    # copy in vLLM's pool, docs/conformance.md, Duplicate copies).
    for rid in sorted(pair.running):
        n = len(pair.m["vllm"].get_block_ids(rid)[0])
        positions = {g: {p for p in range(n) if rng.random() < 0.3} for g in (0, 1)}
        pair.evict(rid, positions)
        _probe_all(pair, prompts, rng)
    for rid in sorted(pair.running):
        pair.free(rid)
        _probe_all(pair, prompts, rng)


@pytest.mark.parametrize("config", CONFIGS[:3])
def test_the_differential_reaches_diverged_hits(config: str) -> None:
    """The seeds above reach groups whose own hits differ (what the per-group look-up is for):
    a finder that answered the reconciled hit for every group fails them. (Groups of one spec
    are looked up together, so their hits never differ.)"""
    diverged = 0
    for seed in SEEDS[:6]:
        rng = random.Random(seed)
        pair = _Pair(config)
        prompts = _family(rng)
        for i, p in enumerate(prompts):
            pair.admit(f"r{i}", p)
        for rid in sorted(pair.running):
            n = len(pair.m["vllm"].get_block_ids(rid)[0])
            if n > 2:
                pair.evict(rid, {rng.randrange(0, 2): {rng.randrange(0, n - 1)}})
        _probe_all(pair, prompts, rng)
        diverged += pair.diverged
    assert diverged > 0


def test_a_window_deeper_than_full_attention() -> None:
    """Full attention's block 1 evicted: its hit is one block, the window's (3 blocks of 4
    tokens, needing 3 cached blocks before the hit point) runs on over blocks 1-3 of its own
    group, which stay cached: 4 blocks, padded with the null block."""
    pair = _Pair("window12")
    prompt = list(range(1, 5 * BS + 2))
    pair.admit("a", prompt)
    pair.evict("a", {0: {1}})
    assert pair.probe(prompt, len(prompt) - 1) == (BS, 5 * BS)
    blocks = pair.m["pagedkv"].coordinator.find_longest_cache_hit_per_group(
        pair.request("p", prompt).block_hashes, len(prompt) - 1
    )[0]
    assert [b.block_id == 0 for b in blocks[1]] == [True, True, False, False, False]
    # The same spec twice: looked up together, one group's gap is both groups'.
    same = _Pair("full_same_spec")
    same.admit("a", prompt)
    same.evict("a", {1: {2}})
    assert same.probe(prompt, len(prompt) - 1) == (2 * BS, 2 * BS)
    pair.check()
    same.check()


def test_the_state_rule_matches_vllms_mamba_finder() -> None:
    """hybrid_hits' Mamba rule (the rightmost cached block, nulls before it) on pagedkv's index
    answers vLLM's ``MambaManager.find_longest_cache_hit`` on vLLM's pool, for the same cached
    contents (Mamba groups are refused at construction, so the rule runs on a full-attention
    group's blocks here, as in tests/vllm/test_vllm_mamba.py)."""
    import torch
    from pagedkv.integrations.vllm import hybrid_hits
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager
    from vllm.v1.kv_cache_interface import MambaSpec

    spec = MambaSpec(block_size=BS, shapes=((1, 1),), dtypes=(torch.float32,), mamba_cache_mode="align")
    rng = random.Random(7)
    pair = _Pair("full_other_spec")
    prompts = _family(rng)
    for i, p in enumerate(prompts):
        pair.admit(f"r{i}", p)
    checked = past_chain = 0
    for rid in sorted(pair.running):
        n = len(pair.m["vllm"].get_block_ids(rid)[0])
        pair.evict(rid, {0: {p for p in range(n) if rng.random() < 0.4}})
        for p in prompts:
            hashes = pair.request("probe", p).block_hashes
            for max_length in (len(p) - 1, rng.randrange(0, len(p))):
                want = MambaManager.find_longest_cache_hit(
                    block_hashes=hashes,
                    max_length=max_length,
                    kv_cache_group_ids=[0],
                    block_pool=pair.m["vllm"].block_pool,
                    kv_cache_spec=spec,
                    drop_eagle_block=False,
                    alignment_tokens=BS,
                )[0][0]
                got = hybrid_hits._state_hit(pair.m["pagedkv"], hashes, [0], max_length // BS)[0]
                assert got == [b.block_id for b in want]
                chain = pair.probe(p, max_length)[0]
                checked += 1
                past_chain += len(got) * BS > chain
    assert checked and past_chain


def test_connector_lookup_without_a_mamba_group_is_get_computed_blocks() -> None:
    """``get_computed_blocks_for_connector`` on a config without a Mamba group: vLLM's answer
    is ``get_computed_blocks``' and not diverged, however the groups' own hits differ; a capped
    look-up holds the admission to its cap, on both managers."""
    prompt = list(range(1, 5 * BS + 2))
    # A window deeper than full attention, and one lagging it (full attention's hit would be a
    # diverged one for a connector on a Mamba config).
    for gap in ({0: {2}}, {1: {3}}):
        _connector_lookups(prompt, gap)


def _connector_lookups(prompt: list[int], gap: dict[int, set[int]]) -> None:
    from vllm.v1.request import RequestStatus

    pair = _Pair("window12")
    pair.admit("a", prompt)
    pair.evict("a", gap)
    for cap in (None, 3 * BS, BS):
        answers = {}
        for kind, m in pair.m.items():
            r = pair.request(f"q{cap}", prompt)
            blocks, hit, boundary, diverged = m.get_computed_blocks_for_connector(r, cap)
            # the shared-prefix boundary too (where full attention's own hit ran past the
            # reconciled one: vLLM's scheduler ends a Mamba prefill chunk there)
            answers[kind] = (hit, boundary, diverged)
            assert m.allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None
            r.status = RequestStatus.RUNNING
            ids = m.get_block_ids(r.request_id)
            # The hit's blocks and the tables' shapes (an evicted block is reused first here,
            # later in vLLM's free queue: docs/integrations/vllm.md, Known differences).
            answers[kind] += (ids[0][: hit // BS], [[b == 0 for b in row] for row in ids])
            m.free(r)
        assert answers["vllm"] == answers["pagedkv"]
        assert answers["vllm"][2] is False
    pair.check()


def test_hostile_arguments_are_typed_errors() -> None:
    """A bound past the hashes given (vLLM's window finder reads past its list: an IndexError)
    or not an int: typed errors, nothing changed; a bound of 0 or below, or no hashes with a
    bound inside them, is no hit."""
    from pagedkv.errors import InvalidArgumentError

    pair = _Pair("window2")
    prompt = list(range(1, 3 * BS + 2))
    pair.admit("a", prompt)
    coordinator = pair.m["pagedkv"].coordinator
    hashes = pair.request("p", prompt).block_hashes
    with pytest.raises(InvalidArgumentError):
        coordinator.find_longest_cache_hit_per_group(hashes, 10 * BS)
    with pytest.raises(InvalidArgumentError):
        coordinator.find_longest_cache_hit_per_group(hashes, "8")
    with pytest.raises(InvalidArgumentError):
        coordinator.find_longest_cache_hit_per_group(hashes, True)
    assert coordinator.find_longest_cache_hit_per_group(hashes, 0) == (([], []), (0, 0))
    assert coordinator.find_longest_cache_hit_per_group(hashes, -5) == (([], []), (0, 0))
    assert coordinator.find_longest_cache_hit_per_group([], BS - 1) == (([], []), (0, 0))
    assert pair.probe(prompt, len(prompt) - 1) == (3 * BS, 3 * BS)
    pair.check()


def test_a_diverged_hit_falls_back_or_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler's protocol around a diverged hit, on pagedkv's manager: the look-up answers
    full attention's hit, diverged (vLLM's answer); the scheduler's fallback to the reconciled
    hit (``get_computed_blocks``, no connector tokens) admits as usual; an admission of the
    diverged hit with a connector's tokens on a config the core's diverged admission does not
    cover is refused by name, changing nothing; a new step forgets the look-up. vLLM looks per
    group only with a Mamba group; the rule is switched on here for a window group that lags
    full attention (hybrid_hits.diverges), which that admission does not cover (the Mamba
    admission itself: tests/vllm/test_vllm_mamba_diverged.py)."""
    from pagedkv.errors import UnsupportedVllmFeatureError
    from pagedkv.integrations.vllm import hybrid_hits
    from vllm.v1.request import RequestStatus

    monkeypatch.setattr(hybrid_hits, "diverges", lambda manager: True)
    pair = _Pair("window12")
    prompt = list(range(1, 5 * BS + 2))
    pair.admit("a", prompt)
    pair.evict("a", {1: {3}})  # the window's hit: 3 blocks; full attention's: 5
    m = pair.m["pagedkv"]
    r = pair.request("q", prompt + list(range(5000, 5000 + 2 * BS)))
    blocks, hit, boundary, diverged = m.get_computed_blocks_for_connector(r)
    assert (hit, boundary, diverged) == (5 * BS, 0, True)
    assert [len(row) for row in blocks.blocks] == [5, 3]
    free = m.block_pool.get_num_free_blocks()
    with pytest.raises(UnsupportedVllmFeatureError, match="diverged"):
        m.allocate_slots(r, 1, hit, blocks, num_external_computed_tokens=BS)
    assert m.block_pool.get_num_free_blocks() == free and r.request_id not in m._reqs
    # A look-up a step before: forgotten at the step's start.
    r2 = pair.request("q2", prompt)
    blocks, hit, _, diverged = m.get_computed_blocks_for_connector(r2)
    assert diverged and m._diverged_hits
    m.new_step_starts()
    assert not m._diverged_hits
    # The scheduler's fallback (no connector tokens): the reconciled hit, admitted.
    m.get_computed_blocks_for_connector(r)
    blocks, hit = m.get_computed_blocks(r)[:2]
    assert hit == 3 * BS
    assert m.allocate_slots(r, r.num_tokens - hit, hit, blocks, num_external_computed_tokens=0) is not None
    r.status = RequestStatus.RUNNING
    m.free(r)
    m.check_invariants()


# ---------------------------------------------------------------- a Mamba group's admission
# with a connector's tokens, on the core (pagedkv's vLLM manager refuses Mamba groups at
# construction today): vLLM's manager on full attention + Mamba ("align") against the core's
# [FullAttention, MambaState] admitted as manager.py's _admit admits (add_sequence with the
# request's hashes, num_scheduled = external + new, num_external_computed_tokens).

MBS = 16


def _mamba_pair(num_blocks: int) -> tuple[Any, Any]:
    import pagedkv
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["fa"], FullAttentionSpec(block_size=MBS, num_kv_heads=1, head_size=1, dtype=torch.float32)
            ),
            KVCacheGroupSpec(
                ["mamba"],
                MambaSpec(
                    block_size=MBS, shapes=((1, 1),), dtypes=(torch.float32,), mamba_cache_mode="align"
                ),
            ),
        ],
    )
    vllm = VllmKVCacheManager(
        config, max_model_len=1024, enable_caching=True, scheduler_block_size=MBS, hash_block_size=MBS
    )
    core = pagedkv.KvCacheManager(
        num_blocks,
        MBS,
        True,
        kv_groups=[pagedkv.FullAttention(), pagedkv.MambaState()],
        max_model_len=1024,
        null_block=0,
    )
    return vllm, core


def _mamba_request(rid: str, tokens: list[int]) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(
        rid, tokens, SamplingParams(max_tokens=4), None, block_hasher=get_request_block_hasher(MBS, sha256)
    )


def _hashes(request: Any) -> list[bytes]:
    import pagedkv

    return [pagedkv.reduce_block_hash(h) for h in request.block_hashes]


def _seed(vllm: Any, core: Any, blocks: int) -> Any:
    """A prefix prefilled one block per step on both (the state cached at every boundary, as
    vLLM's _seed_hybrid_prefix does); the running request."""
    fill = _mamba_request("fill", list(range(blocks * MBS)))
    for i in range(blocks):
        vllm.new_step_starts()
        core.new_step()
        assert vllm.allocate_slots(fill, MBS) is not None
        fill.num_computed_tokens += MBS
        if i == 0:
            core.add_sequence(
                1,
                list(fill.all_token_ids),
                num_scheduled=MBS,
                reserve_prompt=False,
                require_full_prompt=False,
                block_hashes=_hashes(fill),
            )
        else:
            assert core.allocate_slots(1, MBS, num_computed_tokens=i * MBS)
    assert list(vllm.get_block_ids("fill")) == [core.block_table(1, group=g).tolist() for g in (0, 1)]
    vllm.new_step_starts()
    core.new_step()
    return fill


def _admit_both(vllm: Any, core: Any, request: Any, external: int, full: bool) -> tuple[Any, Any]:
    """vLLM's admission with ``external`` connector tokens after its hit, and the core's: each
    manager's tables, or None for a refusal (and vLLM's own failure where its count passed and
    its pool could not give the allocation: ``"raised"``)."""
    from pagedkv.errors import InvalidArgumentError, OutOfBlocksError

    blocks, hit = vllm.get_computed_blocks(request)[:2]
    new = request.num_tokens - hit - external
    try:
        got = vllm.allocate_slots(
            request, new, hit, blocks, num_external_computed_tokens=external, full_sequence_must_fit=full
        )
        want = None if got is None else [list(r) for r in vllm.get_block_ids(request.request_id)]
    except ValueError:  # vLLM's get_new_blocks: "Cannot get N free blocks from the pool"
        want = "raised"
    try:
        core_hit = core.add_sequence(
            2,
            list(request.all_token_ids),
            num_scheduled=external + new,
            reserve_prompt=False,
            require_full_prompt=full,
            block_hashes=_hashes(request),
            num_external_computed_tokens=external,
        )
        assert core_hit == hit
        mine = [core.block_table(2, group=g).tolist() for g in (0, 1)]
    except OutOfBlocksError:
        mine = None
    except InvalidArgumentError:
        # The core's refusal of what could never fit the pool (the manager answers None for
        # it first, capacity.py); vLLM refuses it too.
        mine = None
        assert want is None
    return want, mine


@pytest.mark.parametrize("fill_running", [False, True], ids=["state_evictable", "state_held"])
@pytest.mark.parametrize("full", [True, False], ids=["full_prompt", "chunk_only"])
def test_a_mamba_groups_admission_with_external_tokens_is_vllms(fill_running: bool, full: bool) -> None:
    """After a 4-block prefix (held by its running request, or freed: its state block then
    cached-evictable, which vLLM counts), admissions of 0, 1, 8, 16, 17 and 40 external tokens
    and 1 to 41 new ones on every pool size from too small to enough: vLLM's refusals, tables
    (block ids and nulls: the Mamba row's one block at the last external token, one at the
    chunk's last position) and free blocks, on the core. Where vLLM's count passed and its pool
    could not give the allocation (vLLM raises), the core refuses, changing nothing."""
    import itertools

    refused = raised = admitted = 0
    for num_blocks in range(6, 22):
        for external, extra in itertools.product((0, 1, 8, 16, 17, 40), (0, 5, 16, 40)):
            vllm, core = _mamba_pair(num_blocks)
            if num_blocks < 8:
                continue  # the prefix itself needs 6 blocks and one to spare
            fill = _seed(vllm, core, 4)
            if not fill_running:
                vllm.free(fill)
                core.free(1)
            tail = list(range(5000, 5000 + external + extra + 1))
            request = _mamba_request("r", list(range(4 * MBS)) + tail)
            free = core.num_free_blocks
            want, mine = _admit_both(vllm, core, request, external, full)
            if want == "raised":
                raised += 1
                assert mine is None and core.num_free_blocks == free
            else:
                assert mine == want, (num_blocks, external, extra)
                assert vllm.block_pool.get_num_free_blocks() == core.num_free_blocks
                refused += want is None
                admitted += want is not None
            core.check_invariants()
    assert refused and admitted


@pytest.mark.parametrize("fill_running", [False, True], ids=["state_evictable", "state_held"])
def test_the_managers_admission_with_external_tokens_on_mamba_is_vllms(fill_running: bool) -> None:
    """The same admissions through pagedkv's vLLM manager (full attention + Mamba accepted):
    vLLM's answer (the returned blocks, or None), tables and free blocks after every call."""
    import itertools

    from pagedkv.integrations.vllm import KVCacheManager
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager

    compared = refused = 0
    for num_blocks in range(10, 22, 2):
        for external, extra in itertools.product((1, 8, 16, 17, 40), (0, 5, 16, 40)):
            vllm, _ = _mamba_pair(num_blocks)
            config = vllm.kv_cache_config
            args: dict[str, Any] = dict(
                max_model_len=1024, enable_caching=True, scheduler_block_size=MBS, hash_block_size=MBS
            )
            m = {"vllm": VllmKVCacheManager(config, **args), "pagedkv": KVCacheManager(config, **args)}
            answers: dict[str, Any] = {}
            for kind, manager in m.items():
                fill = _mamba_request("fill", list(range(4 * MBS)))
                for _ in range(4):
                    manager.new_step_starts()
                    assert manager.allocate_slots(fill, MBS) is not None
                    fill.num_computed_tokens += MBS
                if not fill_running:
                    manager.free(fill)
                manager.new_step_starts()
                request = _mamba_request(
                    "r", list(range(4 * MBS)) + list(range(5000, 5000 + external + extra + 1))
                )
                blocks, hit = manager.get_computed_blocks(request)[:2]
                new = request.num_tokens - hit - external
                try:
                    got = manager.allocate_slots(
                        request,
                        new,
                        hit,
                        blocks,
                        num_external_computed_tokens=external,
                        full_sequence_must_fit=True,
                    )
                except ValueError:  # vLLM's pool short of what its count passed
                    got = "raised"
                answer = got if got in (None, "raised") else got.get_block_ids()
                tables = manager.get_block_ids("r") if got not in (None, "raised") else None
                answers[kind] = (hit, answer, tables, manager.block_pool.get_num_free_blocks())
            if answers["vllm"][1] == "raised":
                assert answers["pagedkv"][1] is None
                continue
            assert answers["vllm"] == answers["pagedkv"], (num_blocks, external, extra)
            m["pagedkv"].check_invariants()
            compared += 1
            refused += answers["vllm"][1] is None
    assert compared > refused > 0
