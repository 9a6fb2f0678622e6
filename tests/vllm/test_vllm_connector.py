"""pagedkv's vLLM manager on a KV connector's calls, answered as vLLM's own manager answers them
(each test runs on both managers): external tokens loaded synchronously or asynchronously
(indexed only once loaded), ``reserved_blocks``, the blocks an in-flight load still needs,
deferred frees; the sliding-window and retention checks that vLLM's answers fix; admissions at the
pool's edge (the arithmetic pre-check of the admission). What stays
unsupported is refused by name. Runs in the vLLM stage (scripts/vllm/stage.sh); skipped
elsewhere.
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm_test_inputs import BS, KINDS, mamba_workload
from vllm_test_inputs import kv_cache_config as _config
from vllm_test_inputs import manager as _manager
from vllm_test_inputs import request as _request

# Imported inside the tests; the folder's conftest.py skips them where these do not import.
NEEDS_VLLM = ("pagedkv.integrations.vllm", "vllm.v1.core.sched.scheduler")


def _hit(m: Any, rid: str, num_tokens: int) -> int:
    return int(m.get_computed_blocks(_request(rid, num_tokens))[1])


@pytest.mark.parametrize("kind", KINDS)
def test_window_slots_that_can_never_fit_get_none(kind: str) -> None:
    """A window group needs its window's blocks besides the full-attention ones: slots that
    pass the pool with both get None (admission and a running request), never the core's
    error, which would stop the scheduler's step; nothing changes."""
    m = _manager(kind, _config("full", "swa"))  # 31 usable blocks
    free = m.block_pool.get_num_free_blocks()
    # Admission without the whole-prompt check: a 16-block chunk is 16 + 16 blocks.
    assert m.allocate_slots(_request("a", 40 * BS), 16 * BS, full_sequence_must_fit=False) is None
    # With it: 20 blocks in each group (the window's admission cap is larger).
    assert m.allocate_slots(_request("b", 20 * BS), 8 * BS, full_sequence_must_fit=True) is None
    assert m.block_pool.get_num_free_blocks() == free
    # A running request whose next chunk needs 28 + 22 blocks once the window released 6.
    r = _request("c", 40 * BS)
    assert m.allocate_slots(r, 8 * BS, full_sequence_must_fit=False) is not None
    r.num_computed_tokens = 8 * BS
    held = m.block_pool.get_num_free_blocks()
    assert m.allocate_slots(r, 20 * BS) is None
    assert m.block_pool.get_num_free_blocks() >= held  # vLLM released out-of-window blocks
    assert m.allocate_slots(r, 4 * BS) is not None  # a chunk that fits still does


def test_prefix_cache_retention_interval_is_refused_unless_dense() -> None:
    """pagedkv retains every block (vLLM's None); vLLM's sparse retention would hit less."""
    from pagedkv.integrations.vllm import UnsupportedVllmFeatureError

    _manager("pagedkv", _config("full", "swa", retention=None))
    _manager("pagedkv", _config("full", retention=0))  # no window group: vLLM ignores 0
    with pytest.raises(UnsupportedVllmFeatureError, match="prefix_cache_retention_interval=0"):
        _manager("pagedkv", _config("full", "swa", retention=0))
    with pytest.raises(UnsupportedVllmFeatureError, match="prefix_cache_retention_interval=32"):
        _manager("pagedkv", _config("full", "swa", retention=32))
    # vLLM's own refusals (ValueError), with vLLM's reasons
    with pytest.raises(ValueError, match="no sliding-window or Mamba"):
        _manager("pagedkv", _config("full", retention=32))
    with pytest.raises(ValueError, match="multiple of scheduler_block_size"):
        _manager("pagedkv", _config("full", "swa", retention=24))


@pytest.mark.parametrize("kind", KINDS)
def test_an_async_load_is_indexed_once_loaded(kind: str) -> None:
    """Blocks of external tokens loaded asynchronously (``delay_cache_blocks``) are allocated at
    admission and enter the prefix cache only at ``cache_blocks`` after the load; a load that
    failed part-way caches only its valid prefix."""
    m = _manager(kind, _config("full"), enable_caching=True)
    free = m.block_pool.get_num_free_blocks()
    r = _request("r", 5 * BS)
    blocks, local = m.get_computed_blocks(r)[:2]
    assert local == 0
    got = m.allocate_slots(r, 0, 0, blocks, num_external_computed_tokens=4 * BS, delay_cache_blocks=True)
    assert got is not None and got.get_block_ids() == ([],)  # nothing to compute yet
    assert len(m.get_block_ids("r")[0]) == 4
    assert m.block_pool.get_num_free_blocks() == free - 4
    assert _hit(m, "p", 5 * BS) == 0  # not loaded yet
    r.num_computed_tokens = 3 * BS  # the load's last block failed
    m.cache_blocks(r, 3 * BS)
    assert _hit(m, "p", 5 * BS) == 3 * BS
    assert m.allocate_slots(r, 2 * BS) is not None  # recompute the rest, as the scheduler does
    r.num_computed_tokens = 5 * BS
    assert m.estimate_cached_tokens(r) == 5 * BS
    assert _hit(m, "q", 5 * BS + 1) == 5 * BS


@pytest.mark.parametrize("kind", KINDS)
def test_a_load_of_the_whole_prompt_recomputes_its_last_token(kind: str) -> None:
    """An async load covering the whole prompt: the scheduler rolls the watermark back one
    token to sample; the next ``allocate_slots`` is answered, and the prompt's blocks serve."""
    m = _manager(kind, _config("full"), enable_caching=True)
    r = _request("r", 4 * BS)
    blocks = m.get_computed_blocks(r)[0]
    m.allocate_slots(r, 0, 0, blocks, num_external_computed_tokens=4 * BS, delay_cache_blocks=True)
    r.num_computed_tokens = 4 * BS
    m.cache_blocks(r, 4 * BS)
    r.num_computed_tokens = 4 * BS - 1
    assert m.allocate_slots(r, 1) is not None
    r.num_computed_tokens = 4 * BS
    assert _hit(m, "p", 4 * BS + 1) == 4 * BS


@pytest.mark.parametrize("kind", KINDS)
def test_sync_external_tokens_are_indexed_at_admission(kind: str) -> None:
    m = _manager(kind, _config("full"), enable_caching=True)
    first = _request("first", 2 * BS + 3)
    blocks, hit = m.get_computed_blocks(first)[:2]
    m.allocate_slots(first, 2 * BS + 3, hit, blocks)
    r = _request("r", 6 * BS + 3)  # shares the first 2 blocks
    blocks, local = m.get_computed_blocks(r)[:2]
    assert local == 2 * BS
    got = m.allocate_slots(r, 8, local, blocks, num_external_computed_tokens=3 * BS)
    assert got is not None and len(got.get_block_ids()[0]) == 1  # the block of the 8 new tokens
    assert len(m.get_block_ids("r")[0]) == 6  # 2 hit, 3 external, 1 new
    assert _hit(m, "p", 6 * BS + 3) == 5 * BS


@pytest.mark.parametrize("kind", KINDS)
def test_reserved_blocks_stay_free(kind: str) -> None:
    """``reserved_blocks`` (what in-flight loads still need) must stay free beyond an async
    load's allocation; and the blocks a loading request still needs are counted as vLLM does."""
    m = _manager(kind, _config("full"), enable_caching=True)  # 31 free
    r = _request("r", 10 * BS)
    blocks = m.get_computed_blocks(r)[0]
    args = dict(num_external_computed_tokens=4 * BS, delay_cache_blocks=True)
    assert m.allocate_slots(r, 0, 0, blocks, reserved_blocks=28, **args) is None
    assert m.block_pool.get_num_free_blocks() == 31
    assert m.allocate_slots(r, 0, 0, blocks, reserved_blocks=27, **args) is not None
    count = m.coordinator.get_num_blocks_to_allocate(
        request_id="r",
        num_tokens=10 * BS,
        new_computed_blocks=m.empty_kv_cache_blocks.blocks,
        num_encoder_tokens=0,
        total_computed_tokens=4 * BS,
        num_local_computed_tokens=4 * BS,
        num_tokens_main_model=10 * BS,
        apply_admission_cap=True,
        prefill_end=10 * BS,
    )
    assert count == 6


@pytest.mark.parametrize("kind", KINDS)
def test_deferred_frees_return_the_blocks_later(kind: str) -> None:
    """``pop_blocks_for_free`` hands the blocks over (still held); the scheduler returns them
    through ``block_pool.free_blocks`` (tail first), and they are cached then."""
    m = _manager(kind, _config("full"), enable_caching=True)
    reqs = [_request(str(i), 3 * BS + 2, first=100 * i) for i in range(2)]
    for r in reqs:
        blocks, hit = m.get_computed_blocks(r)[:2]
        m.allocate_slots(r, 3 * BS + 2, hit, blocks)
        r.num_computed_tokens = 3 * BS + 2
    free = m.block_pool.get_num_free_blocks()
    popped = [m.pop_blocks_for_free(r) for r in reqs]
    assert [len(p) for p in popped] == [4, 4]
    assert m.get_block_ids("0") == ([],)
    assert m.block_pool.get_num_free_blocks() == free
    m.block_pool.free_blocks(reversed(popped[1]))
    m.block_pool.free_blocks(reversed(popped[0]))
    assert m.block_pool.get_num_free_blocks() == free + 8
    assert _hit(m, "p", 3 * BS + 2) == 3 * BS


def test_scheduler_takes_a_connector_beside_window_groups(vllm_scheduler: Any) -> None:
    from pagedkv.integrations.vllm import KVCacheManager, PagedkvScheduler

    w = vllm_scheduler.Workload(requests=2, groups=("full", "swa"), connector="sync")
    scheduler = vllm_scheduler.build_scheduler(w, None, scheduler_cls=PagedkvScheduler)
    assert isinstance(scheduler.kv_cache_manager, KVCacheManager)


def test_scheduler_takes_a_connector_beside_mamba_groups(vllm_scheduler: Any) -> None:
    """The one-line switch with a Mamba model and a KV connector: vLLM's scheduler built by
    ``PagedkvScheduler`` runs the fake connector's mixed loads as on vLLM's own manager (the
    differential's connector-mixed-full+mamba, through the scheduler class)."""
    from pagedkv.integrations.vllm import KVCacheManager, PagedkvScheduler, UnsupportedVllmFeatureError

    module = vllm_scheduler
    w = module.Workload(**mamba_workload(155, connector="mixed"))
    ours = module.run(
        w, None, check_invariants=True, watch_copies=False, trace_zeroing=True, scheduler_cls=PagedkvScheduler
    )
    assert ours.manager_type is not None and issubclass(ours.manager_type, KVCacheManager)
    reference = module.run(w, module.manager_class("vllm"), trace_zeroing=True)
    assert module.first_difference(reference, ours) is None
    assert reference.async_loads > 0 and reference.preemptions > 0
    # Beside a window group too, the core's diverged admission would not answer vLLM: named.
    w = module.Workload(**{**mamba_workload(155, connector="sync"), "groups": ("full", "swa", "mamba")})
    with pytest.raises(UnsupportedVllmFeatureError, match="KV-cache group 1 a SlidingWindowSpec"):
        module.build_scheduler(w, None, scheduler_cls=PagedkvScheduler)


@pytest.mark.parametrize("kind", KINDS)
def test_a_capped_hit_is_admitted_as_looked_up(kind: str) -> None:
    """``get_computed_blocks(request, max_cache_hit_length)`` below what the cache holds (an
    auxiliary-output connector caps hits so): admission takes that hit, not the longer one,
    and the chunk it computes is indexed as usual."""
    m = _manager(kind, _config("full"), enable_caching=True)
    first = _request("first", 4 * BS + 1)
    blocks, hit = m.get_computed_blocks(first)[:2]
    m.allocate_slots(first, 4 * BS + 1, hit, blocks)
    r = _request("r", 6 * BS + 1)
    blocks, hit = m.get_computed_blocks(r, max_cache_hit_length=BS)[:2]
    assert hit == BS
    got = m.allocate_slots(r, 5 * BS + 1, hit, blocks)
    assert got is not None and len(got.get_block_ids()[0]) == 6
    assert m.block_pool.get_num_free_blocks() == 31 - 5 - 6
    assert _hit(m, "p", 6 * BS + 1) == 6 * BS
    r.num_computed_tokens = 6 * BS + 1  # the whole prompt computed: a decode step follows
    r.append_output_token_ids(7)
    assert m.allocate_slots(r, 1) is not None


@pytest.mark.parametrize("kind", KINDS)
def test_a_failed_sync_load_leaves_the_index_under_the_fail_policy(kind: str) -> None:
    """A sync load's blocks are indexed at admission; when the worker reports them invalid
    under ``kv_load_failure_policy="fail"``, vLLM's scheduler drops the first invalid block and
    every block after it from the index (``evict_blocks``): no later request hits them, on
    either manager. Under "recompute" vLLM rolls the request back into its indexed blocks,
    which pagedkv's core refuses (``InvalidArgumentError``: never a hit on a block whose load
    failed)."""
    from pagedkv.errors import InvalidArgumentError

    m = _manager(kind, _config("full"), enable_caching=True)
    r = _request("r", 4 * BS + 3)
    blocks = m.get_computed_blocks(r)[0]
    assert m.allocate_slots(r, 3, 0, blocks, num_external_computed_tokens=4 * BS) is not None
    assert _hit(m, "p", 4 * BS + 1) == 4 * BS
    m.evict_blocks(set(m.get_block_ids("r")[0][1:]))
    assert _hit(m, "p", 4 * BS + 1) == BS
    m.free(r)
    assert _hit(m, "p", 4 * BS + 1) == BS
    assert m.block_pool.get_num_free_blocks() == 31
    if kind == "vllm":
        return
    m.check_invariants()
    r = _request("r2", 4 * BS + 3, first=500)
    blocks = m.get_computed_blocks(r)[0]
    assert m.allocate_slots(r, 3, 0, blocks, num_external_computed_tokens=4 * BS) is not None
    r.num_computed_tokens = BS  # "recompute": back to before the first invalid block
    with pytest.raises(InvalidArgumentError):
        m.allocate_slots(r, 3 * BS + 3)
    m.free(r)
    m.check_invariants()


@pytest.mark.parametrize("seed", range(6))
def test_admissions_at_the_pools_edge_answer_as_vllm(seed: int) -> None:
    """The manager refuses some admissions before asking the core (the arithmetic pre-check of
    ``_admit``, full attention): on both managers, the same calls near the pool's edge (hits on
    held and on cached-evictable blocks, the watermark, reserved blocks, lookahead, with and
    without the whole-sequence check) get the same
    answer, hit and free blocks. A pre-check that counted a block too many refuses an admission
    vLLM makes; one too few is harmless (the core refuses)."""
    import random

    from vllm.v1.request import RequestStatus

    rng = random.Random(seed)
    managers = {
        kind: _manager(kind, _config("full", num_blocks=24), watermark=0.125 * (seed % 2)) for kind in KINDS
    }
    requests: dict[str, list[Any]] = {kind: [] for kind in KINDS}
    answers: list[tuple[Any, ...]] = []
    for step in range(60):
        held = requests["vllm"]
        if held and rng.random() < 0.3:
            victim = rng.randrange(len(held))
            for kind in KINDS:
                managers[kind].free(requests[kind].pop(victim))
            continue
        # Prompts from 4 shared prefixes (hits), some longer than what is free; none ends at a
        # block's end (a hit capped one token short computes a second copy of a cached block,
        # which vLLM indexes and pagedkv does not: docs/conformance.md, Duplicate copies).
        first = 1000 * rng.randrange(4)
        num_tokens = rng.randrange(1, 14) * BS + 1 + rng.randrange(BS - 1)
        chunk = rng.choice([num_tokens, BS * rng.randrange(1, 6)])
        lookahead = rng.choice([0, 0, 3])
        reserved = rng.choice([0, 0, 2])
        status = rng.choice([RequestStatus.WAITING, RequestStatus.PREEMPTED])
        # vLLM's whole-sequence check (scheduler_reserve_full_isl), with chunks shorter than the
        # prompt: the pre-check's second bound.
        must_fit = rng.random() < 0.5
        answer: list[Any] = [step, must_fit]
        for kind in KINDS:
            m = managers[kind]
            r = _request(f"r{step}", num_tokens, first)
            r.status = status
            blocks, hit, _ = m.get_computed_blocks(r)
            new = max(min(chunk, num_tokens - hit), 1)
            got = m.allocate_slots(
                r,
                new,
                hit,
                blocks,
                num_lookahead_tokens=lookahead,
                reserved_blocks=reserved,
                full_sequence_must_fit=must_fit,
            )
            if got is not None:
                requests[kind].append(r)
            answer.append((hit, got is None, m.block_pool.get_num_free_blocks()))
        answers.append(tuple(answer))
        assert answer[2] == answer[3], f"step {step}: vLLM {answer[2]}, pagedkv {answer[3]}"
        managers["pagedkv"].check_invariants()
    # The sweep reaches both answers, with hits, with and without the whole-sequence check.
    for must_fit in (False, True):
        outcomes = [a[2] for a in answers if a[1] == must_fit]
        assert any(o[1] for o in outcomes) and any(not o[1] for o in outcomes)
    assert any(a[2][0] and a[2][1] for a in answers)
