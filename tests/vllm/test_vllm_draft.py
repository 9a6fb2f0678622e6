"""Speculative decoders' options on pagedkv's vLLM manager (python/pagedkv/integrations/vllm/draft.py):
EAGLE's dropped hit block (``use_eagle``), lookahead hashing (``num_hash_lookahead_tokens``) and
prefill lookahead (``num_prefill_lookahead``). Every test runs the same calls on vLLM's own
manager and on pagedkv's and compares, after every call, the answer (the hit, the number of new
blocks, ``None``), the free blocks, the hit of a probe of the request's tokens so far, the
cached-tokens estimate and, with events on, the KV events; pagedkv's ``check_invariants`` runs
after every call too. Runs in the vLLM stage (scripts/vllm/stage.sh); skipped elsewhere.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import pytest

# Imported inside the tests; the folder's conftest.py skips them where these do not import.
NEEDS_VLLM = ("pagedkv.integrations.vllm", "vllm.v1.core.kv_cache_manager")

BS = 4


@dataclass(frozen=True)
class Options:
    """One configuration of the options, as vLLM's scheduler passes them to its manager."""

    use_eagle: bool = False
    hash_lookahead: int = 0
    prefill_lookahead: int = 0
    events: bool = False
    num_blocks: int = 40
    slot_lookahead: int = 0  # the scheduler's num_lookahead_tokens (drafter's slots)
    # The KV-cache groups: this many full-attention groups, then one sliding-window group per
    # window (in tokens); the groups marked ``is_eagle_group`` (none: vLLM drops in all).
    groups: int = 1
    windows: tuple[int, ...] = ()
    eagle_groups: tuple[int, ...] = ()


# What vLLM 0.33's config gives (vllm/config/vllm.py): EAGLE with prefix caching hashes one
# token ahead and drops nothing; multi-token prediction (3 modules) hashes and re-prefills 3;
# with lookahead hashes disabled (or a KV connector) EAGLE drops its hit's last block, and
# multi-module MTP also re-prefills.
CONFIGS = {
    "eagle-lookahead-hash": Options(hash_lookahead=1, prefill_lookahead=1, events=True, slot_lookahead=2),
    "mtp3-lookahead-hash": Options(hash_lookahead=3, prefill_lookahead=3, events=True, slot_lookahead=3),
    "mtp3-reprefill-only": Options(prefill_lookahead=3, events=True, slot_lookahead=3),
    "eagle-drop": Options(use_eagle=True, prefill_lookahead=1, slot_lookahead=2),
    "mtp3-drop": Options(use_eagle=True, prefill_lookahead=3, slot_lookahead=3),
    "eagle-drop-small-pool": Options(use_eagle=True, prefill_lookahead=1, num_blocks=16, slot_lookahead=2),
    # On several groups (vLLM's hybrid coordinator) and on one window group (its unitary one),
    # windows of 2 blocks (8 tokens: 2 blocks before a hit, 3 with the drop) and more. The drop
    # makes a hit recompute a block vLLM then indexes twice; the pools are large enough that
    # nothing is evicted, and a comparison stops only where vLLM's hit revives an evictable
    # copy that pagedkv shares (``_differential`` checks that this is where they part).
    "eagle-drop-full-swa": Options(
        num_blocks=600, use_eagle=True, prefill_lookahead=1, slot_lookahead=2, windows=(8,)
    ),
    "eagle-drop-full-swa-wide": Options(
        num_blocks=600, use_eagle=True, prefill_lookahead=1, slot_lookahead=2, windows=(13,)
    ),
    "eagle-drop-swa-only": Options(
        num_blocks=600, use_eagle=True, prefill_lookahead=1, slot_lookahead=2, groups=0, windows=(8,)
    ),
    "eagle-drop-2full-swa": Options(
        num_blocks=600, use_eagle=True, prefill_lookahead=1, slot_lookahead=2, groups=2, windows=(5,)
    ),
    "eagle-drop-full-2windows": Options(
        use_eagle=True, prefill_lookahead=1, slot_lookahead=2, num_blocks=600, windows=(8, 17)
    ),
    "eagle-drop-flagged-full": Options(
        num_blocks=600, use_eagle=True, prefill_lookahead=1, slot_lookahead=2, windows=(8,), eagle_groups=(0,)
    ),
    "eagle-drop-flagged-window": Options(
        num_blocks=600, use_eagle=True, prefill_lookahead=1, slot_lookahead=2, windows=(8,), eagle_groups=(1,)
    ),
    "eagle-drop-small-pool-full-swa": Options(
        use_eagle=True, prefill_lookahead=1, num_blocks=22, slot_lookahead=2, windows=(8,)
    ),
    # is_eagle_group on one of two full-attention groups of one spec: vLLM marks the whole
    # spec set, so both drop and cache to the same point (not a mix)
    "mtp3-drop-flagged-same-spec": Options(
        num_blocks=600, use_eagle=True, prefill_lookahead=3, slot_lookahead=3, groups=2, eagle_groups=(0,)
    ),
    "mtp3-drop-full-swa": Options(
        num_blocks=600, use_eagle=True, prefill_lookahead=3, slot_lookahead=3, windows=(8,)
    ),
    "eagle-lookahead-hash-full-swa": Options(
        num_blocks=600, hash_lookahead=1, prefill_lookahead=1, events=True, slot_lookahead=2, windows=(8,)
    ),
    "mtp3-lookahead-hash-full-swa": Options(
        num_blocks=600, hash_lookahead=3, prefill_lookahead=3, events=True, slot_lookahead=3, windows=(8,)
    ),
    "mtp3-reprefill-only-full-swa": Options(
        num_blocks=600, prefill_lookahead=3, events=True, slot_lookahead=3, windows=(8,)
    ),
    "eagle-drop-events-full-swa": Options(
        num_blocks=600, use_eagle=True, prefill_lookahead=1, events=True, slot_lookahead=2, windows=(8,)
    ),
}


def _config(num_blocks: int, groups: int = 1, window: int | None = None, opts: Options | None = None) -> Any:
    """``groups`` full-attention groups, then a window group per window (``window``, or
    ``opts.windows`` with ``opts.groups`` and its EAGLE marks)."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    windows: tuple[int, ...] = () if window is None else (window,)
    marked: tuple[int, ...] = ()
    if opts is not None:
        groups, windows, marked = opts.groups, opts.windows, opts.eagle_groups
    kw = dict(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
    specs: list[Any] = [FullAttentionSpec(**kw) for _ in range(groups)]
    specs += [SlidingWindowSpec(**kw, sliding_window=w) for w in windows]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([f"l{i}"], s, is_eagle_group=i in marked) for i, s in enumerate(specs)
        ],
    )


def _manager(kind: str, opts: Options, config: Any = None) -> Any:
    from pagedkv.integrations.vllm import KVCacheManager
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager

    cls = VllmKVCacheManager if kind == "vllm" else KVCacheManager
    return cls(
        _config(opts.num_blocks, opts=opts) if config is None else config,
        max_model_len=96,
        scheduler_block_size=BS,
        hash_block_size=BS,
        enable_caching=True,
        use_eagle=opts.use_eagle,
        num_hash_lookahead_tokens=opts.hash_lookahead,
        num_prefill_lookahead=opts.prefill_lookahead,
        enable_kv_cache_events=opts.events,
    )


class _Run:
    """One manager under a schedule, noting after every call what both must agree on."""

    def __init__(self, kind: str, opts: Options) -> None:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        init_none_hash(sha256)
        self.opts = opts
        self.m = _manager(kind, opts)
        self.hasher = get_request_block_hasher(BS, sha256, opts.hash_lookahead)
        self.seen: list[tuple[Any, ...]] = []
        # vLLM's manager only: the first call after which its index held two copies of a content
        self.duplicates_since: int | None = None
        # vLLM's manager only: the first admission whose hit took a cached-evictable copy of a
        # content whose other copy a running request holds, where pagedkv's one indexed copy
        # is the held one (docs/conformance.md, Duplicate copies: the usual first difference)
        self.revived_copy_since: int | None = None
        if kind == "vllm":
            self._watch_revived_copies()

    def _watch_revived_copies(self) -> None:
        from conftest import _load_bench

        revives_held_copy = _load_bench("vllm_scheduler").revives_held_copy
        allocate = self.m.allocate_slots

        def watched(request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
            if self.revived_copy_since is None and revives_held_copy(self.m, args, kwargs):
                self.revived_copy_since = len(self.seen)  # this call's note
            return allocate(request, num_new_tokens, *args, **kwargs)

        self.m.allocate_slots = watched

    def request(self, rid: str, prompt: list[int], max_tokens: int = 64) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), None, block_hasher=self.hasher)

    def note(self, what: str, request: Any, answer: Any) -> None:
        """``answer``: an allocation's new blocks (``_new_blocks``), None, or a call's own answer.
        Noted with it: the free blocks, a probe of the request's tokens so far (its hit, its
        shared-prefix boundary and which positions of each group's hit are the null block),
        the request's tables (which positions are the null block), the cached estimate and,
        with events on, the KV events."""
        probe = self.request("probe", [*request.all_token_ids, 0])
        blocks, hit, boundary = self.m.get_computed_blocks(probe)
        probed = (hit, boundary, tuple(tuple(b.is_null for b in row) for row in blocks.blocks))
        tables = tuple(tuple(b == 0 for b in ids) for ids in self.m.get_block_ids(request.request_id))
        cached = self.m.estimate_cached_tokens(request) if any(tables) else 0
        events = self.m.take_events() if self.opts.events else []
        self.seen.append(
            (what, answer, self.m.block_pool.get_num_free_blocks(), probed, tables, cached, events)
        )
        index = getattr(self.m.block_pool, "cached_block_hash_to_block", None)
        if self.duplicates_since is None and index is not None:
            # vLLM's index holds two blocks of one content (docs/conformance.md, Duplicate copies)
            if any(isinstance(c, dict) and len(c) >= 2 for c in index._cache.values()):
                self.duplicates_since = len(self.seen) - 1
        if hasattr(self.m, "check_invariants"):
            self.m.check_invariants()


def _new_blocks(got: Any) -> tuple[int, ...] | None:
    """An allocation's answer: its new blocks per group (None: refused)."""
    return None if got is None else tuple(len(ids) for ids in got.get_block_ids())


def _prompts(rng: random.Random, n: int) -> list[list[int]]:
    """Prompts sharing prefixes (a resend now and then), so hits happen and blocks recur."""
    bases = [[rng.randrange(1, 9) for _ in range(rng.randrange(10, 30))] for _ in range(3)]
    out: list[list[int]] = []
    for _ in range(n):
        if out and rng.random() < 0.2:
            out.append(list(rng.choice(out)))
            continue
        base = rng.choice(bases)
        cut = rng.randrange(1, len(base) + 1)
        out.append(base[:cut] + [rng.randrange(1, 9) for _ in range(rng.randrange(0, 9))])
    return out


def _schedule(run: _Run, seed: int) -> dict[str, int]:
    """A scheduler's calls, as vLLM's makes them: admissions (look-up, then ``allocate_slots``
    of a chunk with the hit, the whole prompt required to fit), prefill chunks that never end
    within the prefill lookahead of the prompt's end, decode steps with drafts of which a random
    prefix is accepted (the watermark rolled back), ``cache_blocks`` after some steps,
    preemption on a refused slot, frees at the end. Returns what it exercised."""
    from vllm.v1.request import RequestStatus

    rng = random.Random(seed)
    m, opts = run.m, run.opts
    prompts = _prompts(rng, 14)
    waiting = [run.request(f"r{i}", p, max_tokens=rng.randrange(2, 14)) for i, p in enumerate(prompts)]
    running: list[Any] = []
    stats = {"hits": 0, "preemptions": 0, "refusals": 0, "rejected": 0, "cache_blocks": 0}
    P = max(opts.prefill_lookahead, 1)

    def chunk_of(r: Any, start: int, budget: int) -> int:
        n = min(r.num_tokens - start, budget)
        rest = r.num_tokens - start - n
        if 0 < rest < P:  # vLLM's _reserve_prefill_lookahead
            n -= P - rest
        return max(n, 0)

    def preempt(r: Any) -> None:
        m.free(r)
        r.status = RequestStatus.PREEMPTED
        r.num_computed_tokens = 0
        r.num_preemptions += 1
        running.remove(r)
        waiting.insert(0, r)
        stats["preemptions"] += 1
        run.note(f"preempt {r.request_id}", r, None)

    for _step in range(200):
        if not waiting and not running:
            break
        for r in list(running):
            if r not in running:
                continue
            if r.num_computed_tokens < r.num_tokens - 1:  # prefill chunk (a resumed one: its outputs too)
                n = chunk_of(r, r.num_computed_tokens, rng.randrange(3, 12))
                if n == 0:
                    continue
                got = m.allocate_slots(r, n, num_lookahead_tokens=opts.slot_lookahead)
                run.note(
                    f"chunk {r.request_id} {r.num_computed_tokens}+{n}",
                    r,
                    _new_blocks(got),
                )
                if got is None:
                    preempt(r)
                    continue
                r.num_computed_tokens += n
                if r.num_computed_tokens == r.num_tokens:
                    r.append_output_token_ids(rng.randrange(1, 9))
            else:  # decode with drafts
                drafts = rng.randrange(0, 4)
                got = m.allocate_slots(r, 1 + drafts, num_lookahead_tokens=opts.slot_lookahead)
                run.note(
                    f"decode {r.request_id} {r.num_computed_tokens}+{1 + drafts}",
                    r,
                    _new_blocks(got),
                )
                if got is None:
                    preempt(r)
                    continue
                accepted = rng.randrange(0, drafts + 1)
                stats["rejected"] += drafts - accepted
                r.num_computed_tokens += 1 + accepted
                r.append_output_token_ids([rng.randrange(1, 9) for _ in range(accepted + 1)])
            if rng.random() < 0.5:
                m.cache_blocks(r, r.num_computed_tokens)
                stats["cache_blocks"] += 1
                run.note(f"cache_blocks {r.request_id} {r.num_computed_tokens}", r, None)
            if r.num_output_tokens >= r.max_tokens and r.num_computed_tokens >= r.num_tokens - 1:
                m.free(r)
                running.remove(r)
                run.note(f"free {r.request_id}", r, None)
        for r in list(waiting[:3]):
            blocks, hit = m.get_computed_blocks(r)[:2]
            n = chunk_of(r, hit, rng.randrange(4, 24))
            if n == 0:
                continue
            got = m.allocate_slots(
                r, n, hit, blocks, num_lookahead_tokens=opts.slot_lookahead, full_sequence_must_fit=True
            )
            run.note(
                f"admit {r.request_id} hit {hit} +{n}",
                r,
                _new_blocks(got),
            )
            if got is None:
                stats["refusals"] += 1
                break
            stats["hits"] += hit > 0
            waiting.remove(r)
            running.append(r)
            r.status = RequestStatus.RUNNING
            r.num_computed_tokens = hit + n
            if r.num_computed_tokens == r.num_tokens:
                r.append_output_token_ids(rng.randrange(1, 9))
    return stats


def _differential(opts: Options, seed: int) -> tuple[int, dict[str, int]]:
    """Runs one seeded schedule on both managers: every call must give the same answer, free
    count, probe hit, cached estimate and events until vLLM's index first holds two copies of
    one content (docs/conformance.md, Duplicate copies: pagedkv keeps one and reports its store
    once, and from there the pools may evict differently). From that call on the events are
    left out (vLLM reports each copy) and the rest is compared up to its first difference, the
    explained divergence, where the comparison stops. Returns the calls compared (all of them
    unless the runs parted)."""
    runs = {kind: _Run(kind, opts) for kind in ("vllm", "pagedkv")}
    stats = {kind: _schedule(run, seed) for kind, run in runs.items()}
    got, want = runs["pagedkv"].seen, runs["vllm"].seen
    since = runs["vllm"].duplicates_since
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if since is not None and i >= since:
            if a[:-1] != b[:-1]:
                if (opts.windows or opts.groups != 1) and opts.num_blocks >= 100:
                    # Nothing evicted (a pool this large): the runs part only where vLLM
                    # revives a copy pagedkv shares. With evictions (the small pools) the
                    # other consequences of duplicate copies part them too.
                    revived = runs["vllm"].revived_copy_since
                    assert revived is not None and i >= revived, (i, revived, a, b)
                return i, stats["pagedkv"]
        else:
            assert a == b, f"call {i}: pagedkv {a} != vLLM {b}"
    assert len(got) == len(want)
    return len(got), stats["pagedkv"]


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_schedules_equal_vllm(config: str) -> None:
    """Seeded schedules on both managers (``_differential``): they reach hits, rejected drafts
    and ``cache_blocks`` (preemptions or refusals on the small pool), and at least 200 calls
    are compared over the seeds."""
    total: dict[str, int] = {}
    compared = []
    for seed in range(4):
        calls, stats = _differential(CONFIGS[config], seed)
        compared.append(calls)
        for k, v in stats.items():
            total[k] = total.get(k, 0) + v
    assert total["hits"] > 0 and total["rejected"] > 0 and total["cache_blocks"] > 0
    assert sum(compared) >= 200, compared
    if CONFIGS[config].num_blocks < 20:
        assert total["preemptions"] + total["refusals"] > 0


def _one(opts: Options, scenario: Any) -> list[tuple[Any, ...]]:
    runs = {kind: _Run(kind, opts) for kind in ("vllm", "pagedkv")}
    for run in runs.values():
        scenario(run)
    assert runs["pagedkv"].seen == runs["vllm"].seen
    return runs["pagedkv"].seen


def _admit(run: _Run, r: Any) -> None:
    from vllm.v1.request import RequestStatus

    blocks, hit = run.m.get_computed_blocks(r)[:2]
    got = run.m.allocate_slots(r, r.num_tokens - hit, hit, blocks, full_sequence_must_fit=True)
    run.note(f"admit {r.request_id} hit {hit}", r, _new_blocks(got))
    r.status = RequestStatus.RUNNING
    r.num_computed_tokens = r.num_tokens


@pytest.mark.parametrize("prompt_len", [8, 11, 12, 13, 16])
def test_eagle_drops_the_last_hit_block(prompt_len: int) -> None:
    """An identical prompt after its first copy was freed: the hit is the cached run within
    ``num_tokens - 1`` less one block, and the dropped block is allocated anew."""

    def scenario(run: _Run) -> None:
        tokens = list(range(1, prompt_len + 1))
        first = run.request("a", tokens)
        _admit(run, first)
        run.m.free(first)
        run.note("free a", first, None)
        _admit(run, run.request("b", tokens))

    seen = _one(Options(use_eagle=True), scenario)
    hit = seen[-1][0].split()[-1]
    assert int(hit) == max((prompt_len - 1) // BS - 1, 0) * BS


def test_prefill_lookahead_caches_all_but_the_reprefilled_tokens() -> None:
    """Multi-token prediction with 3 modules: of ``n`` tokens to cache, the last 2 may be
    re-prefilled, so a block ending past ``n - 2`` is not indexed yet (probe hits and the
    cached estimate say so), and is at the call that moves ``n`` on."""

    def scenario(run: _Run) -> None:
        from vllm.v1.request import RequestStatus

        r = run.request("r", list(range(1, 11)))  # 10 tokens: blocks 0, 1 full
        got = run.m.allocate_slots(r, 9, full_sequence_must_fit=True)  # 9 - 2: block 0 only
        run.note("admit 9", r, _new_blocks(got))
        r.status = RequestStatus.RUNNING
        r.num_computed_tokens = 9
        got = run.m.allocate_slots(r, 1)  # 10 - 2: block 1 too
        run.note("chunk 1", r, _new_blocks(got))
        r.num_computed_tokens = 10
        r.append_output_token_ids(11)
        run.m.cache_blocks(r, 10)
        run.note("cache_blocks 10", r, None)

    seen = _one(Options(prefill_lookahead=3, events=True), scenario)
    assert [s[3][0] for s in seen] == [4, 8, 8]


@pytest.mark.parametrize("lookahead", [1, 2])
def test_lookahead_events_reconstruct_the_hashes(lookahead: int) -> None:
    """With lookahead hashing the store events carry each block's lookahead tokens and the
    extra keys of its window (equal to vLLM's; vLLM's own test rebuilds the hashes from them)."""

    def scenario(run: _Run) -> None:
        r = run.request("r", list(range(1, 2 * BS + lookahead + 1)))
        got = run.m.allocate_slots(r, r.num_tokens)
        run.note("admit", r, _new_blocks(got))

    seen = _one(Options(hash_lookahead=lookahead, events=True), scenario)
    (event,) = seen[0][-1]
    assert event.lookahead_token_ids == [[5, 6][:lookahead], [9, 10][:lookahead]]


PAST_THE_PROMPT = {
    "plain": Options(),
    "plain-full-swa": Options(windows=(8,)),
    **{name: CONFIGS[name] for name in ("eagle-drop", "eagle-drop-full-swa", "eagle-drop-flagged-window")},
}


@pytest.mark.parametrize("config", sorted(PAST_THE_PROMPT))
def test_an_admission_past_the_prompt_is_answered_as_vllms(config: str) -> None:
    """An admission scheduling the whole prompt on top of its hit (more slots than the prompt
    has tokens, as vLLM's own test_swa_shared_prefix_reuse_under_zero_retention asks): vLLM
    allocates the slots and caches the prompt; so does pagedkv's (the slots past the tokens are
    lookahead slots in the core, which computes no token it has no id of: its record and the
    core's agreed on a shorter table before), and the next request hits what vLLM's does."""

    def scenario(run: _Run) -> None:
        shared = [7] * (4 * BS)
        for i, tail in enumerate((50, 60, 70)):
            r = run.request(f"r{i}", shared + [tail] * (4 * BS))
            blocks, hit = run.m.get_computed_blocks(r)[:2]
            got = run.m.allocate_slots(r, r.num_tokens, hit, blocks)
            run.note(f"admit r{i} hit {hit}", r, _new_blocks(got))

    seen = _one(PAST_THE_PROMPT[config], scenario)
    hits = [int(s[0].split()[-1]) for s in seen]
    assert hits[1] == hits[2] > 0, hits


def test_refused_combinations_are_named() -> None:
    """A Mamba group with these options, and prefill lookahead with the drop on some groups
    only: refused at construction by name; vLLM's own refusal of a prefill lookahead past a
    block with EAGLE is a ValueError on both; prefix caching off: nothing to refuse (vLLM
    caches nothing)."""
    from pagedkv.errors import UnsupportedVllmFeatureError
    from pagedkv.integrations.vllm import KVCacheManager
    from vllm_test_inputs import mamba_config

    def make(config: Any, opts: Options, caching: bool = True) -> Any:
        return KVCacheManager(
            config,
            max_model_len=96,
            scheduler_block_size=BS,
            hash_block_size=BS,
            enable_caching=caching,
            use_eagle=opts.use_eagle,
            num_hash_lookahead_tokens=opts.hash_lookahead,
            num_prefill_lookahead=opts.prefill_lookahead,
        )

    for opts in (Options(use_eagle=True), Options(hash_lookahead=1), Options(prefill_lookahead=2)):
        with pytest.raises(UnsupportedVllmFeatureError, match="MambaSpec"):
            make(mamba_config(20, None, block_size=BS), opts)
        make(_config(20, window=8), opts)
    mixed = Options(use_eagle=True, prefill_lookahead=3, windows=(8,), eagle_groups=(0,))
    with pytest.raises(UnsupportedVllmFeatureError, match="some KV-cache groups only"):
        make(_config(20, opts=mixed), mixed)
    make(_config(20, opts=mixed), Options(use_eagle=True, prefill_lookahead=1))
    # The drop on a window of one token (vLLM caches its blocks for the peek only)
    one = Options(use_eagle=True, windows=(1,))
    with pytest.raises(UnsupportedVllmFeatureError, match="window of one token"):
        make(_config(20, opts=one), one)
    # vLLM's engine widens its windows for multi-module MTP (extra_retained_tokens): refused
    import dataclasses

    config = _config(20, window=8)
    group = config.kv_cache_groups[1]
    config.kv_cache_groups[1] = dataclasses.replace(
        group, kv_cache_spec=dataclasses.replace(group.kv_cache_spec, extra_retained_tokens=2)
    )
    with pytest.raises(UnsupportedVllmFeatureError, match="extra_retained_tokens=2"):
        make(config, Options(use_eagle=True, prefill_lookahead=3))
    # vLLM's ValueError (the dropped block must hold the re-prefilled tokens)
    for kind in ("vllm", "pagedkv"):
        with pytest.raises(ValueError, match="scheduler_block_size"):
            _manager(kind, Options(use_eagle=True, prefill_lookahead=BS + 1))
    with pytest.raises(ValueError, match="negative"):
        make(_config(20), Options(prefill_lookahead=-1))


@pytest.mark.parametrize("external_blocks", [1, 2, 3])
@pytest.mark.parametrize("config", ["eagle-drop", "mtp3-drop", "eagle-drop-full-swa", "mtp3-drop-full-swa"])
def test_connector_tokens_with_the_drop_are_answered_as_vllms(config: str, external_blocks: int) -> None:
    """A KV connector's synchronous load after a hit with EAGLE's drop (vLLM turns lookahead
    hashing off with a connector, so EAGLE with a connector always drops): the hit's blocks,
    the connector's blocks and the computed ones are allocated and cached as vLLM's manager
    allocates and caches them (multi-token prediction's re-prefillable tokens left uncached),
    and a later request hits what vLLM's does."""
    from vllm.v1.request import RequestStatus

    external = external_blocks * BS

    def scenario(run: _Run) -> None:
        shared = list(range(1, 4 * BS + 1))
        first = run.request("first", shared + [90, 91, 92])
        _admit(run, first)
        # (first stays: the block the drop recomputes is then a private copy in both indexes'
        # eyes; freed, vLLM would serve its evictable original, Duplicate copies)
        r = run.request("r", shared + list(range(200, 200 + 4 * BS + 3)))
        blocks, hit = run.m.get_computed_blocks(r)[:2]
        n = r.num_tokens - hit - external
        got = run.m.allocate_slots(r, n, hit, blocks, num_external_computed_tokens=external)
        run.note(f"admit r hit {hit} external {external}", r, _new_blocks(got))
        r.status = RequestStatus.RUNNING
        r.num_computed_tokens = r.num_tokens
        r.append_output_token_ids(5)
        run.m.cache_blocks(r, r.num_computed_tokens)
        run.note("cache_blocks r", r, None)
        probe = run.request("later", [*r.all_token_ids, 7, 7, 7, 7])
        _admit(run, probe)

    seen = _one(CONFIGS[config], scenario)
    assert int(seen[1][0].split()[3]) > 0  # the drop left a hit under the connector's tokens
    assert seen[-1][3][0] > int(seen[1][0].split()[3])  # the later request hits past it


def test_async_loads_with_the_drop_cache_as_vllms() -> None:
    """A connector's asynchronous load with EAGLE's drop and prefill lookahead: the load's
    blocks are held unindexed until it finished, then cached to vLLM's point (``cache_blocks``
    of the loaded tokens less the re-prefillable ones)."""
    from vllm.v1.request import RequestStatus

    def scenario(run: _Run) -> None:
        r = run.request("r", list(range(1, 6 * BS + 3)))
        got = run.m.allocate_slots(r, 0, num_external_computed_tokens=5 * BS, delay_cache_blocks=True)
        run.note("admit async", r, _new_blocks(got))
        r.status = RequestStatus.WAITING
        r.num_computed_tokens = 5 * BS
        run.m.cache_blocks(r, 5 * BS)
        run.note("load finished", r, None)
        blocks, hit = run.m.get_computed_blocks(r)[:2]
        assert blocks is not None
        got = run.m.allocate_slots(r, r.num_tokens - 5 * BS, 0, None)
        run.note("resume", r, _new_blocks(got))

    for name in ("mtp3-drop", "eagle-drop", "mtp3-drop-full-swa"):
        seen = _one(CONFIGS[name], scenario)
        assert seen[1][5] == (4 if name.startswith("mtp3") else 5) * BS  # the loaded blocks cached
        if name.endswith("drop"):
            assert seen[1][3][0] > 0  # and hit (beside a window only its last blocks are held)


def test_scheduler_takes_a_connector_with_the_drop(vllm_scheduler: Any) -> None:
    """``PagedkvScheduler`` builds with a KV connector and EAGLE's dropped block or MTP's
    prefill lookahead (the schedules are the scheduler differential's connector configs)."""
    from pagedkv.integrations.vllm import KVCacheManager, PagedkvScheduler

    module = vllm_scheduler
    for drafter in ("eagle-drop", "mtp3-drop"):
        w = module.Workload(requests=2, num_blocks=40, num_spec_tokens=2, connector="sync", drafter=drafter)
        scheduler = module.build_scheduler(w, None, PagedkvScheduler)
        assert isinstance(scheduler.kv_cache_manager, KVCacheManager)
