"""pagedkv's Mamba state group against vLLM's align-mode ``MambaManager``, call by call
(docs/integrations/vllm.md, Mamba; docs/design.md, KV groups, "State groups"): the core's
``MambaState`` group driven directly (``_CorePair``) and pagedkv's vLLM manager on a
full-attention + Mamba config (``_ManagerPair``), each beside vLLM's manager on the same
scheduler steps, plus what the Mamba path refuses. The state-hit finder and vLLM's tables
against the documented rule are in test_vllm_mamba.py. Runs in the vLLM stage
(scripts/vllm/stage.sh); skipped elsewhere.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

# Imported inside the tests; the folder's conftest.py skips them where these do not import.
NEEDS_VLLM = ("pagedkv.integrations.vllm", "vllm.v1.core.single_type_kv_cache_manager")

BS = 4
NUM_BLOCKS = 96


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
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        init_none_hash(sha256)
        config = _mamba_config(num_blocks)
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


def _drive(pair: Any, seed: int, shared: bool) -> Any:
    """Seeded steps on a pair (``_CorePair`` or ``_ManagerPair``): prompts sharing prefixes of
    one base (``shared``) or each its own (no hit, so never a second copy: pressure, preemption
    and eviction compared to the end)."""
    rng = random.Random(seed)
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


# What each finished seeded run reached, by (differential, window, seed, shared): the reach
# tests below count the parametrized runs instead of running them again, and run only the ones
# they find missing (deselected, or run in another process).
_REACHED: dict[tuple[object, ...], dict[str, int]] = {}


def _core_differential(seed: int, num_blocks: int, shared: bool) -> _CorePair:
    """``_drive``'s schedule on ``_CorePair``."""
    pair = _drive(_CorePair(num_blocks), seed, shared)
    _REACHED["core", None, seed, shared] = dict(
        hits=pair.hits,
        refused=pair.refused_this_step,
        interior=pair.interior_nulls,
        preempted=pair.preempted,
        compared=pair.compared if shared else 0,
    )
    return pair


def _reached(differential: str, window: object, run: Callable[[int, bool], object]) -> dict[str, int]:
    """The totals of the 24 seeded runs of `differential` (`run(seed, shared)` for the ones not
    run yet in this process)."""
    totals: dict[str, int] = {}
    for seed in range(12):
        for shared in (True, False):
            key = (differential, window, seed, shared)
            if key not in _REACHED:
                run(seed, shared)
            for name, count in _REACHED[key].items():
                totals[name] = totals.get(name, 0) + count
    return totals


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
    totals = _reached(
        "core", None, lambda seed, shared: _core_differential(seed, NUM_BLOCKS * 4 if shared else 40, shared)
    )
    assert set(totals) == {"hits", "refused", "interior", "preempted", "compared"}, totals
    assert all(v > 0 for v in totals.values()), totals
    assert totals["compared"] > 12 * 50, totals


class _ManagerPair:
    """vLLM's manager and pagedkv's vLLM manager (``pagedkv.integrations.vllm``) on one full
    attention + align-mode Mamba config, driven by the same scheduler calls; compared after
    every call as ``_CorePair`` compares the core (plus the blocks each ``allocate_slots``
    returns)."""

    def __init__(
        self, num_blocks: int, window: int | None = None, checkpoint_alignment: int | None = None
    ) -> None:
        from pagedkv.integrations.vllm import KVCacheManager
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        init_none_hash(sha256)
        options: dict[str, Any] = {}
        if checkpoint_alignment is not None:
            # vLLM's Mamba2 layers: one prefill check-point block, at any token (alignment 1)
            options = dict(num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=checkpoint_alignment)
        config = _mamba_config(num_blocks, window, **options)
        args: dict[str, Any] = dict(max_model_len=256, scheduler_block_size=BS, hash_block_size=BS)
        self.m = {
            "vllm": VllmKVCacheManager(config, enable_caching=True, **args),
            "pagedkv": KVCacheManager(config, enable_caching=True, **args),
        }
        self.hasher = get_request_block_hasher(BS, sha256)
        self.reqs: dict[str, dict[str, Any]] = {}
        self.hits = self.refused_this_step = self.preempted = self.compared = self.junctions = 0
        self.checkpoints = 0  # allocations vLLM's Mamba group took a check-point block in
        self.parted = False

    def step(self) -> None:
        for m in self.m.values():
            m.new_step_starts()

    def note_checkpoint(self, rid: str) -> None:
        """Counts vLLM's Mamba group's check-point of this allocation (``_checkpoints``)."""
        mamba = self.m["vllm"].coordinator.single_type_managers[1]
        self.checkpoints += rid in getattr(mamba, "_checkpoints", {})

    def admit(self, rid: str, prompt: list[int], chunk_blocks: int) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request, RequestStatus

        got, hits, rs, boundaries = {}, {}, {}, {}
        for kind, m in self.m.items():
            r = Request(rid, prompt, SamplingParams(max_tokens=64), None, block_hasher=self.hasher)
            blocks, hit, boundaries[kind] = m.get_computed_blocks(r)
            n = min(chunk_blocks * BS, len(prompt) - hit)
            got[kind] = m.allocate_slots(r, n, hit, blocks)
            hits[kind], rs[kind] = hit, r
            if kind == "vllm" and got[kind] is None and hit:
                mamba = m.coordinator.single_type_managers[1]
                self.refused_this_step += blocks.blocks[1][-1].block_hash in mamba.cached_blocks_this_step
            if got[kind] is not None:
                r.status = RequestStatus.RUNNING
                r.num_computed_tokens = hit + n
        assert hits["vllm"] == hits["pagedkv"], (rid, hits)
        # the shared-prefix boundary: vLLM's scheduler ends a Mamba prefill chunk there
        assert boundaries["vllm"] == boundaries["pagedkv"], (rid, hits, boundaries)
        self.junctions += boundaries["vllm"] > 0
        assert (got["vllm"] is None) == (got["pagedkv"] is None), (rid, hits, got)
        if got["vllm"] is not None:
            self.hits += hits["vllm"] > 0
            self.note_checkpoint(rid)
            self.same_new_blocks(got)
            self.reqs[rid] = rs
        self.check()

    def run(self, rid: str, chunk_blocks: int, token: int) -> None:
        rs = self.reqs[rid]
        got = {}
        for kind, m in self.m.items():
            r = rs[kind]
            c = r.num_computed_tokens
            n = min(chunk_blocks * BS, r.num_prompt_tokens - c) if c < r.num_prompt_tokens else 1
            if c >= r.num_prompt_tokens:
                r.append_output_token_ids(token)
            got[kind] = m.allocate_slots(r, n)
            if got[kind] is not None:
                r.num_computed_tokens = c + n
        assert (got["vllm"] is None) == (got["pagedkv"] is None), (rid, got)
        if got["vllm"] is None:
            self.preempted += 1
            self.free(rid)
            return
        self.note_checkpoint(rid)
        self.same_new_blocks(got)
        self.check()

    def same_new_blocks(self, got: dict[str, Any]) -> None:
        ids = {kind: b.get_block_ids() for kind, b in got.items()}
        for g in range(len(ids["vllm"])):
            theirs, ours = ids["vllm"][g], ids["pagedkv"][g]
            assert [b == 0 for b in theirs] == [b == 0 for b in ours], (g, ids)

    def free(self, rid: str) -> None:
        for kind, r in self.reqs.pop(rid).items():
            self.m[kind].free(r)
        self.check()

    def evict_state(self, rid: str) -> None:
        for m in self.m.values():
            m.evict_blocks({b for b in m.get_block_ids(rid)[1] if b != 0})
        self.check()

    def check(self) -> None:
        vllm, ours = self.m["vllm"], self.m["pagedkv"]
        ours.check_invariants()
        assert vllm.block_pool.get_num_free_blocks() == ours.block_pool.get_num_free_blocks()
        names: dict[int, int] = {}
        for rid in self.reqs:
            for theirs_t, ours_t in zip(vllm.get_block_ids(rid), ours.get_block_ids(rid), strict=True):
                assert len(theirs_t) == len(ours_t), (rid, theirs_t, ours_t)
                for v, p in zip(theirs_t, ours_t, strict=True):
                    assert (v == 0) == (p == 0), (rid, theirs_t, ours_t)
                    assert names.setdefault(v, p) == p, (rid, theirs_t, ours_t)
        assert len(set(names.values())) == len(names), "not a bijection"
        self.compared += 1
        index = vllm.block_pool.cached_block_hash_to_block._cache
        self.parted = any(isinstance(copies, dict) and len(copies) >= 2 for copies in index.values())


def _manager_differential(
    seed: int, num_blocks: int, shared: bool, window: int | None = None, checkpoints: int | None = None
) -> _ManagerPair:
    """``_drive``'s schedule on ``_ManagerPair`` (``window``: with a sliding-window group too;
    ``checkpoints``: the Mamba group's prefill check-point alignment)."""
    pair = _drive(_ManagerPair(num_blocks, window, checkpoints), seed, shared)
    reached = dict(
        hits=pair.hits,
        refused=pair.refused_this_step,
        preempted=pair.preempted,
        compared=pair.compared,
        junctions=pair.junctions,
    )
    if checkpoints is None:
        _REACHED["manager", window, seed, shared] = reached
    else:
        _REACHED["checkpoints", (window, checkpoints), seed, shared] = {
            **reached,
            "checkpoints": pair.checkpoints,
        }
    return pair


# Besides full attention and Mamba: no window, a window of 2 tokens (a Mamba group's own
# release rule) and one of 3 blocks and a token.
WINDOWS = [None, 2, 3 * BS + 1]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("seed", range(12))
def test_the_vllm_manager_on_a_mamba_config_matches_vllms(
    seed: int, shared: bool, window: int | None
) -> None:
    """pagedkv's vLLM manager on full attention + align-mode Mamba (+ a sliding-window group)
    against vLLM's, call by call (the plain path: no connector, no speculative blocks, no KV
    events)."""
    _manager_differential(seed, NUM_BLOCKS * 4 if shared else 40, shared, window)


@pytest.mark.parametrize("window", WINDOWS)
def test_the_manager_differential_reaches_what_it_checks(window: int | None) -> None:
    totals = _reached(
        "manager",
        window,
        lambda seed, shared: _manager_differential(seed, NUM_BLOCKS * 4 if shared else 40, shared, window),
    )
    assert set(totals) == {"hits", "refused", "preempted", "compared", "junctions"}, totals
    assert all(v > 0 for v in totals.values()), totals


# Prefill check-points (vLLM's Mamba2 layers: num_prefill_checkpoint_blocks=1 with an
# alignment of 1 token; 2 tokens for another rule's residue), beside no window and a window of 2.
CHECKPOINTS = [(None, 1), (None, 2), (2, 1)]


@pytest.mark.parametrize(("window", "alignment"), CHECKPOINTS)
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("seed", range(12))
def test_prefill_checkpoints_match_vllms(seed: int, shared: bool, window: int | None, alignment: int) -> None:
    """The call-by-call differential with the Mamba group's prefill check-points on: a prompt's
    last chunk that starts on a block boundary and spans one past the next takes the state block
    of its last boundary as well (vLLM's ``MambaManager`` check-point), counted in the same
    refusals, indexed, then released at the next allocation."""
    _manager_differential(seed, NUM_BLOCKS * 4 if shared else 40, shared, window, alignment)


@pytest.mark.parametrize(("window", "alignment"), CHECKPOINTS)
def test_the_checkpoint_differential_reaches_what_it_checks(window: int | None, alignment: int) -> None:
    totals = _reached(
        "checkpoints",
        (window, alignment),
        lambda seed, shared: _manager_differential(
            seed, NUM_BLOCKS * 4 if shared else 40, shared, window, alignment
        ),
    )
    assert totals["checkpoints"] > 20 and totals["hits"] > 0 and totals["preempted"] > 0, totals


def _mamba_config(num_blocks: int = 32, window: int | None = None, **mamba_options: Any) -> Any:
    """Full attention + an align-mode Mamba group (+ a window group), blocks of ``BS`` tokens."""
    from vllm_test_inputs import mamba_config

    return mamba_config(num_blocks, window, block_size=BS, **mamba_options)


@pytest.mark.parametrize(
    ("config", "kwargs", "named"),
    [
        (dict(mamba_cache_mode="none"), {}, "mamba_cache_mode='none'"),
        (dict(num_speculative_blocks=1), {}, "num_speculative_blocks"),
        ({}, dict(enable_caching=False), "without prefix caching"),
        ({}, dict(use_eagle=True), "use_eagle"),
    ],
)
def test_what_the_mamba_path_refuses_is_named_at_construction(
    config: dict[str, Any], kwargs: dict[str, Any], named: str
) -> None:
    from pagedkv.integrations.vllm import KVCacheManager, UnsupportedVllmFeatureError

    args: dict[str, Any] = dict(max_model_len=256, scheduler_block_size=BS, hash_block_size=BS)
    args.update(enable_caching=True)
    args.update(kwargs)
    with pytest.raises(UnsupportedVllmFeatureError, match=named):
        KVCacheManager(_mamba_config(**config), **args)


def test_lookahead_is_refused_changing_nothing() -> None:
    """Lookahead slots on a Mamba config (no draft model has Mamba layers; vLLM's align mode
    ignores them): refused, the tables unchanged. A connector's async loads and reserved blocks
    are answered (the scheduler differential's connector-mixed configurations)."""
    from pagedkv.errors import InvalidArgumentError
    from pagedkv.integrations.vllm import KVCacheManager
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request, RequestStatus

    init_none_hash(sha256)
    m = KVCacheManager(
        _mamba_config(), max_model_len=256, enable_caching=True, scheduler_block_size=BS, hash_block_size=BS
    )
    hasher = get_request_block_hasher(BS, sha256)
    r = Request("a", list(range(1, 11)), SamplingParams(max_tokens=8), None, block_hasher=hasher)
    assert m.allocate_slots(r, 10) is not None
    r.status, r.num_computed_tokens = RequestStatus.RUNNING, 10
    tables = m.get_block_ids("a")
    with pytest.raises(InvalidArgumentError):
        m.allocate_slots(r, 1, num_lookahead_tokens=2)
    assert m.get_block_ids("a") == tables
    m.check_invariants()
    # The coordinator's new_step_starts is the manager's (vLLM's calls it through either).
    m.coordinator.new_step_starts()


@pytest.mark.parametrize("external_blocks", [1, 2, 3])
def test_a_connectors_tokens_with_kv_events_are_reported_as_vllms(external_blocks: int) -> None:
    """A synchronous load's admission with KV events on, on both managers: vLLM's Mamba group
    counts the positions of every computed token but the last as cached (null blocks, the
    connector's tokens included), so its first state store starts there, not at the local hit
    (mamba.admitted_cached_blocks); the events are equal, and so are the boundary-state offers."""
    from pagedkv.integrations.vllm import KVCacheManager as PagedkvManager
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BS, sha256)
    answers = []
    for cls in (VllmManager, PagedkvManager):
        m = cls(
            _mamba_config(),
            max_model_len=256,
            enable_caching=True,
            enable_kv_cache_events=True,
            scheduler_block_size=BS,
            hash_block_size=BS,
        )
        r = Request("a", list(range(1, 4 * BS + 3)), SamplingParams(max_tokens=8), None, block_hasher=hasher)
        external = external_blocks * BS
        m.new_step_starts()
        blocks = m.allocate_slots(r, 4 * BS + 2 - external, num_external_computed_tokens=external)
        assert blocks is not None
        offers = m.take_boundary_state_offloads()
        offered = {rid: [(group, tokens) for group, _, tokens in v] for rid, v in offers.items()}
        answers.append((m.take_events(), m.get_block_ids("a"), offered))
        if cls is PagedkvManager:
            m.check_invariants()
    (vllm_events, vllm_ids, vllm_offers), (events, ids, offers) = answers
    assert events == vllm_events
    assert [len(g) for g in ids] == [len(g) for g in vllm_ids]
    assert offers == vllm_offers
    stored = [e for e in events if e.group_idx == 1]
    # The range starts at the last external block (the null-padded positions before it are
    # counted cached) and ends with the call's full blocks: not at the local hit (none here).
    tokens = list(range(1, 4 * BS + 3))
    assert stored and stored[0].token_ids == tokens[(external_blocks - 1) * BS : 4 * BS]


@pytest.mark.parametrize("prompt_len", range(4 * BS - 1, 6 * BS + 1))  # at most the pool
def test_a_sequence_filling_the_pool_is_answered_as_vllm_answers(prompt_len: int) -> None:
    """A tiny pool (5 usable blocks): the whole prompt in one chunk, then decode until the pool
    runs out; the state group counts one block per step, not its table's length, so both
    managers admit and refuse at the same token (the can-never-fit arithmetic, capacity.py)."""
    pair = _ManagerPair(6)
    pair.step()
    pair.admit("a", list(range(1, prompt_len + 1)), 10)
    for step in range(3 * BS):
        if "a" not in pair.reqs:
            break
        pair.step()
        pair.run("a", 1, 1000 + step)


def test_a_connector_beside_prefill_checkpoints_is_named(vllm_scheduler: Any) -> None:
    """A KV connector's tokens on a Mamba group with prefill check-points: ``PagedkvScheduler``
    refuses the config at construction; the manager refuses the admission by name, changing
    nothing."""
    from pagedkv.integrations.vllm import PagedkvScheduler, UnsupportedVllmFeatureError
    from vllm_test_inputs import mamba_workload

    module = vllm_scheduler
    w = module.Workload(**mamba_workload(140, connector="sync", mamba_checkpoint_alignment=1))
    with pytest.raises(UnsupportedVllmFeatureError, match="prefill check-points"):
        module.build_scheduler(w, None, scheduler_cls=PagedkvScheduler)
    pair = _ManagerPair(40, None, 1)
    m = pair.m["pagedkv"]
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    r = Request("a", list(range(1, 4 * BS + 2)), SamplingParams(max_tokens=4), None, block_hasher=pair.hasher)
    free = m.block_pool.get_num_free_blocks()
    with pytest.raises(UnsupportedVllmFeatureError, match="prefill check-points"):
        m.allocate_slots(r, BS + 1, num_external_computed_tokens=3 * BS)
    assert m.block_pool.get_num_free_blocks() == free and m.get_block_ids("a") == ([], [])
    m.check_invariants()
