"""A KV connector beside a sliding-window group, on both managers call by call: vLLM's
``allocate_slots(..., num_external_computed_tokens=e)`` gives a window group's positions out of
its window at the hit plus ``e`` the null block and does not count them (pagedkv: the core's
``AdmitOptions::num_external_computed_tokens``); the other connector paths (async loads and their
resume, the reservation query, ``remove_skipped_blocks``, deferred frees, preemption) answer as
vLLM's. Windows of one block, 48 tokens and 2 tokens, on tiny pools. Runs in the vLLM stage
(scripts/vllm/stage.sh); skipped elsewhere.
"""

# Every closure of the sweep below runs (through ``both``) in the loop iteration that defines it.
# ruff: noqa: B023

from __future__ import annotations

import random
from typing import Any

import pytest
from vllm_test_inputs import BS, KINDS, both_managers, kv_cache_config
from vllm_test_inputs import request as _request

NEEDS_VLLM = ("pagedkv.integrations.vllm", "vllm.v1.core.sched.scheduler")

WINDOWS = (16, 48, 2)


def _managers(window: int, num_blocks: int, **kwargs: Any) -> dict[str, Any]:
    """Both managers on full attention + a window of ``window`` tokens, prefix caching on."""
    config = kv_cache_config("full", "swa", num_blocks=num_blocks, window=window)
    return both_managers(config, **{"enable_caching": True, **kwargs})


def _ids(answer: Any) -> Any:
    return None if answer is None else answer.get_block_ids()


@pytest.mark.parametrize("window", WINDOWS)
def test_external_tokens_beside_a_window_take_vllms_tables(window: int) -> None:
    """A sync load after a local hit, ``e`` not on a block boundary: the window's positions
    before its window at the hit plus ``e`` are the null block, in the table and the answer."""
    ms = _managers(window, 40)
    got = {}
    for kind, m in ms.items():
        first = _request("first", 3 * BS + 1)
        blocks, hit = m.get_computed_blocks(first)[:2]
        m.allocate_slots(first, 3 * BS + 1, hit, blocks)
        r = _request("r", 12 * BS + 5)  # shares the first 3 blocks
        blocks, hit = m.get_computed_blocks(r)[:2]
        assert hit == 3 * BS
        answer = m.allocate_slots(r, 9, hit, blocks, num_external_computed_tokens=6 * BS + 7)
        got[kind] = (
            _ids(answer),
            m.get_block_ids("r"),
            m.block_pool.get_num_free_blocks(),
            m.get_computed_blocks(_request("p", 12 * BS + 5))[1:],  # the hit and the shared-prefix boundary
        )
        if kind == "pagedkv":
            m.check_invariants()
    assert got["pagedkv"] == got["vllm"]
    assert got["vllm"][1][1][0] == 0  # the window released positions at admission


@pytest.mark.parametrize("window", WINDOWS)
def test_external_tokens_are_not_counted_where_the_window_skips_them(window: int) -> None:
    """The admission's free-block checks count only what the window keeps: on a pool that
    holds the full group's blocks and the window's only, both managers admit (and refuse one
    block fewer), with and without the whole-prompt check."""
    for must_fit in (True, False):
        for num_blocks in range(14, 30):
            answers = {}
            for kind, m in _managers(window, num_blocks).items():
                r = _request("r", 12 * BS + 3)
                blocks, hit = m.get_computed_blocks(r)[:2]
                answer = m.allocate_slots(
                    r, 3, hit, blocks, num_external_computed_tokens=12 * BS, full_sequence_must_fit=must_fit
                )
                answers[kind] = (_ids(answer), m.block_pool.get_num_free_blocks())
            assert answers["pagedkv"] == answers["vllm"], (must_fit, num_blocks)


@pytest.mark.parametrize("window", WINDOWS)
def test_an_async_load_beside_a_window_resumes_as_vllm(window: int) -> None:
    """An async load: admitted without computing, the reservation query while it loads, its
    ``cache_blocks`` once loaded, the resume's ``allocate_slots`` (vLLM's watermark applies),
    decode steps past the window, ``remove_skipped_blocks`` at the end, a deferred free."""
    from vllm.v1.request import RequestStatus

    trace: dict[str, list[Any]] = {kind: [] for kind in KINDS}
    # max_in_flight_tokens bounds the window's admission cap below the request's blocks.
    for kind, m in _managers(window, 30, watermark=0.1, max_in_flight_tokens=32).items():
        t = trace[kind]
        r = _request("r", 8 * BS + 5)
        blocks = m.get_computed_blocks(r)[0]
        t.append(
            _ids(
                m.allocate_slots(
                    r, 0, 0, blocks, num_external_computed_tokens=8 * BS, delay_cache_blocks=True
                )
            )
        )
        t.append(m.get_block_ids("r"))
        r.num_computed_tokens = 8 * BS
        for cap in (True, False):
            t.append(
                m.coordinator.get_num_blocks_to_allocate(
                    request_id="r",
                    num_tokens=r.num_tokens + 40,
                    new_computed_blocks=m.empty_kv_cache_blocks.blocks,
                    num_encoder_tokens=0,
                    total_computed_tokens=r.num_computed_tokens,
                    num_local_computed_tokens=r.num_computed_tokens,
                    num_tokens_main_model=r.num_tokens + 40,
                    apply_admission_cap=cap,
                )
            )
        m.cache_blocks(r, r.num_computed_tokens)
        t.append(m.get_computed_blocks(_request("p", 8 * BS + 5))[1])
        r.status = RequestStatus.WAITING
        t.append(_ids(m.allocate_slots(r, 5)))
        r.status = RequestStatus.RUNNING
        r.num_computed_tokens += 5
        for step in range(40):
            r.append_output_token_ids(step)
            t.append(_ids(m.allocate_slots(r, 1)))
            r.num_computed_tokens += 1
        m.remove_skipped_blocks("r", r.num_computed_tokens)
        t.append(m.get_block_ids("r"))
        t.append(m.block_pool.get_num_free_blocks())
        popped = m.pop_blocks_for_free(r)
        t.append([b.block_id for b in popped])
        m.block_pool.free_blocks(reversed(popped))
        t.append(m.block_pool.get_num_free_blocks())
        t.append(m.get_computed_blocks(_request("q", 8 * BS + 5))[1])
        if kind == "pagedkv":
            m.check_invariants()
    assert trace["pagedkv"] == trace["vllm"]


def _load_points(window: int, hit: int, num_tokens: int, rng: random.Random) -> int:
    """External tokens after a hit: aligned or not, up to the token before the last."""
    room = num_tokens - 1 - hit
    if room <= 0:
        return 0
    return rng.choice([rng.randrange(room + 1), room // BS * BS, min(room, window)])


@pytest.mark.parametrize("seed", range(40))
def test_connector_calls_beside_a_window_answer_as_vllm(seed: int) -> None:
    """A randomized sweep of a connector's calls on tiny pools (windows of one block, 48 and
    2 tokens): sync and async loads after local hits, resumes, running steps and preemption
    (a refused step frees the request, as the scheduler does), the reservation query,
    ``remove_skipped_blocks`` before a finished request's tables are read, deferred and plain
    frees. After every call both managers' answers, free blocks and every request's tables
    are the same, block id for block id (a deferred free's order included: see
    ``test_deferred_frees_evict_in_vllms_order``; and a refused step's window release, which
    vLLM runs before it counts blocks: seed 18 refuses a step past the pool, seeds 33 and 39
    one short of the watermark, the latter granted once the release freed blocks); pagedkv's
    invariants hold."""
    from vllm.v1.request import RequestStatus

    rng = random.Random(seed)
    window = WINDOWS[seed % 3]
    ms = _managers(window, rng.choice([24, 32, 40]), watermark=0.05 * (seed % 2))
    reqs: dict[str, dict[str, Any]] = {}  # rid -> kind -> request
    loading: set[str] = set()
    popped: list[dict[str, Any]] = []
    answers = 0

    def both(call: Any) -> list[Any]:
        out = [call(kind, ms[kind]) for kind in KINDS]
        assert out[0] == out[1], out
        ms["pagedkv"].check_invariants()
        return out

    for step in range(120):
        choice = rng.random()
        if choice < 0.3 or not reqs:
            rid = f"r{step}"
            first = 1000 * step  # no prefix shared: no second copy of a content (see above)
            num_tokens = rng.randrange(2, 14) * BS + rng.randrange(BS)
            made = {kind: _request(rid, num_tokens, first) for kind in KINDS}
            hits = both(lambda kind, m: m.get_computed_blocks(made[kind])[1])
            hit = hits[0]
            e = _load_points(window, hit, num_tokens, rng)
            async_load = e > 0 and rng.random() < 0.4
            n = 0 if async_load else rng.randrange(1, num_tokens - hit - e + 1)
            reserved = rng.choice([0, 0, 3])
            must_fit = rng.random() < 0.7

            def admit(kind: str, m: Any) -> Any:
                r = made[kind]
                blocks = m.get_computed_blocks(r)[0]
                got = m.allocate_slots(
                    r,
                    n,
                    hit,
                    blocks,
                    num_external_computed_tokens=e,
                    delay_cache_blocks=async_load,
                    reserved_blocks=reserved if async_load else 0,
                    full_sequence_must_fit=must_fit,
                )
                return _ids(got), m.block_pool.get_num_free_blocks(), m.get_block_ids(rid)

            got = both(admit)[0]
            answers += got[0] is not None
            if got[0] is None:
                continue
            reqs[rid] = made
            for r in made.values():
                r.num_computed_tokens = hit + e + n
                r.status = RequestStatus.WAITING if async_load else RequestStatus.RUNNING
            if async_load:
                loading.add(rid)
        elif choice < 0.4 and loading:
            rid = rng.choice(sorted(loading))
            loading.discard(rid)
            made = reqs[rid]

            def loaded(kind: str, m: Any) -> Any:
                r = made[kind]
                m.cache_blocks(r, r.num_computed_tokens)
                left = r.num_tokens - r.num_computed_tokens
                got = m.allocate_slots(r, rng_n, has_scheduled_reqs=True) if left > 0 else None
                return _ids(got), m.block_pool.get_num_free_blocks(), m.get_block_ids(rid)

            rng_n = rng.randrange(1, max(made["vllm"].num_tokens - made["vllm"].num_computed_tokens, 1) + 1)
            got = both(loaded)[0]
            for r in made.values():
                if got[0] is not None:
                    r.status = RequestStatus.RUNNING
                    r.num_computed_tokens += rng_n
        elif choice < 0.8:
            running = sorted(rid for rid in reqs if rid not in loading)
            if not running:
                continue
            rid = rng.choice(running)
            made = reqs[rid]
            r0 = made["vllm"]
            left = r0.num_tokens - r0.num_computed_tokens
            k = rng.randrange(1, left + 1) if left > 0 else 1
            for r in made.values():
                if left <= 0:
                    r.append_output_token_ids(7)
            got = both(
                lambda kind, m: (
                    _ids(m.allocate_slots(made[kind], k)),
                    m.block_pool.get_num_free_blocks(),
                    m.get_block_ids(rid),
                )
            )[0]
            if got[0] is None:  # preempted, as the scheduler does
                both(lambda kind, m: (m.free(made[kind]), m.block_pool.get_num_free_blocks()))
                del reqs[rid]
                continue
            for r in made.values():
                r.num_computed_tokens += k
        elif choice < 0.9:
            for rid, made in sorted(reqs.items()):
                both(
                    lambda kind, m: m.coordinator.get_num_blocks_to_allocate(
                        request_id=rid,
                        num_tokens=made[kind].num_tokens + 20,
                        new_computed_blocks=m.empty_kv_cache_blocks.blocks,
                        num_encoder_tokens=0,
                        total_computed_tokens=made[kind].num_computed_tokens,
                        num_local_computed_tokens=made[kind].num_computed_tokens,
                        num_tokens_main_model=made[kind].num_tokens + 20,
                        apply_admission_cap=True,
                    )
                )
        else:
            running = sorted(rid for rid in reqs if rid not in loading)
            if popped and rng.random() < 0.5:
                blocks = popped.pop(0)
                both(
                    lambda kind, m: (
                        m.block_pool.free_blocks(reversed(blocks[kind])),
                        m.block_pool.get_num_free_blocks(),
                    )
                )
                continue
            if not running:
                continue
            rid = rng.choice(running)
            made = reqs.pop(rid)

            def finish(kind: str, m: Any) -> Any:
                r = made[kind]
                m.remove_skipped_blocks(rid, r.num_computed_tokens)
                return m.get_block_ids_for_computed_tokens(rid, r.num_computed_tokens)

            both(finish)
            if rng.random() < 0.5:
                lists = {kind: ms[kind].pop_blocks_for_free(made[kind]) for kind in KINDS}
                assert [b.block_id for b in lists["vllm"]] == [b.block_id for b in lists["pagedkv"]]
                popped.append(lists)
            else:
                both(lambda kind, m: (m.free(made[kind]), m.block_pool.get_num_free_blocks()))
    assert answers > 5


def test_a_failed_async_load_beside_a_window() -> None:
    """A failed async load (the scheduler lowers the watermark to the valid prefix): where the
    window released no position the lower watermark reads, both managers cache the valid
    prefix and resume alike (zeroing its unwritten blocks); where it did (a window of one block,
    the load failing 3 blocks short), vLLM's table holds the null block there and goes on,
    which pagedkv refuses by name, changing nothing."""
    from pagedkv.integrations.vllm import UnsupportedVllmFeatureError
    from vllm.v1.request import RequestStatus

    for window, valid in ((512, 5 * BS), (48, 7 * BS)):
        results = {}
        for kind, m in _managers(window, 30).items():
            r = _request("r", 8 * BS + 5)
            blocks = m.get_computed_blocks(r)[0]
            m.allocate_slots(r, 0, 0, blocks, num_external_computed_tokens=8 * BS, delay_cache_blocks=True)
            r.num_computed_tokens = valid
            if kind == "pagedkv" and window == 48:
                free = m.block_pool.get_num_free_blocks()
                with pytest.raises(UnsupportedVllmFeatureError, match="rolled back"):
                    m.cache_blocks(r, valid)
                assert m.block_pool.get_num_free_blocks() == free
                m.check_invariants()
                continue
            m.cache_blocks(r, valid)
            r.status = RequestStatus.WAITING
            got = m.allocate_slots(r, 3 * BS + 5)
            results[kind] = (
                _ids(got),
                m.get_block_ids("r"),
                m.get_computed_blocks(_request("p", 8 * BS + 5))[1],
            )
        if window == 512:
            assert results["pagedkv"] == results["vllm"]
        else:  # released at 128 tokens: 5 blocks; the window at 112 reads the 5th
            assert results["vllm"][1][1][:5] == [0] * 5


def test_hostile_external_tokens_are_typed_errors() -> None:
    """External tokens past the prompt (after the hit), or negative: ``InvalidArgumentError``,
    nothing allocated; a window hit plus external tokens not on a block boundary is answered
    as vLLM answers it (above)."""
    from pagedkv.errors import InvalidArgumentError

    m = _managers(16, 30)["pagedkv"]
    free = m.block_pool.get_num_free_blocks()
    r = _request("r", 4 * BS)
    for e in (4 * BS + 1, 10**9, -1):
        with pytest.raises(InvalidArgumentError):
            m.allocate_slots(r, 1, 0, None, num_external_computed_tokens=e)
        assert m.block_pool.get_num_free_blocks() == free
        assert m.get_block_ids("r") == ([], [])
    m.check_invariants()


def _evicting_trace(m: Any, deferred: bool) -> list[Any]:
    """Two requests computed whole and finished (deferred: ``pop_blocks_for_free``, then
    ``block_pool.free_blocks`` of the popped blocks reversed, as the scheduler's drain does;
    else ``free``), then admissions of new content that evict their cached blocks: each
    answer's block ids, the free blocks, the events, and at the end the hits left."""
    t: list[Any] = []
    finished = []
    for rid, first, num_tokens in (("a", 0, 5 * BS + 3), ("b", 1000, 4 * BS + 9)):
        r = _request(rid, num_tokens, first)
        blocks, hit = m.get_computed_blocks(r)[:2]
        t.append(_ids(m.allocate_slots(r, num_tokens - hit, hit, blocks)))
        r.num_computed_tokens = num_tokens
        m.remove_skipped_blocks(rid, num_tokens)
        finished.append(r)
    popped = []
    for r in finished:
        if deferred:
            popped.append(m.pop_blocks_for_free(r))
            t.append([b.block_id for b in popped[-1]])
        else:
            m.free(r)
    for blocks in popped:
        m.block_pool.free_blocks(reversed(blocks))
    t.append(m.block_pool.get_num_free_blocks())
    t.append(m.take_events())
    for i in range(4):
        r = _request(f"c{i}", 2 * BS + 1, 5000 + 100 * i)
        blocks, hit = m.get_computed_blocks(r)[:2]
        t.append(_ids(m.allocate_slots(r, r.num_tokens - hit, hit, blocks)))
        t.append(m.take_events())
    t.append(m.block_pool.get_num_free_blocks())
    t.append(
        [
            m.get_computed_blocks(_request("p", n, first))[1]
            for first, n in ((0, 5 * BS + 3), (1000, 4 * BS + 9))
        ]
    )
    return t


@pytest.mark.parametrize("deferred", [True, False], ids=["deferred", "plain"])
@pytest.mark.parametrize("window", WINDOWS)
def test_deferred_frees_evict_in_vllms_order(window: int, deferred: bool) -> None:
    """vLLM's scheduler frees a deferred free's blocks in one ``free_blocks`` call, the popped
    list (every group's blocks in allocation order, group after group) reversed: the last
    group's cached blocks enter the eviction order before the first group's, where a plain
    ``free`` releases group after group. Later admissions that evict take the same block ids,
    evict the same cached blocks (their events) and leave the same hits on both managers."""
    traces = {}
    for kind, m in _managers(window, 24, enable_kv_cache_events=True).items():
        traces[kind] = _evicting_trace(m, deferred)
        if kind == "pagedkv":
            m.check_invariants()
    assert traces["pagedkv"] == traces["vllm"]


@pytest.mark.parametrize("window", WINDOWS)
def test_the_shared_prefix_boundary_is_vllms(window: int) -> None:
    """``get_computed_blocks``' third answer: where full attention's own hit runs past the
    reconciled one (the window's block at the prompt's end evicted), vLLM reports full
    attention's hit as the shared-prefix boundary (its scheduler ends a Mamba prefill chunk
    there, its offloading connector keeps the junction); 0 where the groups agree."""
    answers: dict[str, list[Any]] = {kind: [] for kind in KINDS}
    for kind, m in _managers(window, 40).items():
        a = _request("a", 8 * BS + 1)
        blocks, hit = m.get_computed_blocks(a)[:2]
        m.allocate_slots(a, 8 * BS + 1, hit, blocks)
        a.num_computed_tokens = 8 * BS + 1
        m.cache_blocks(a, 8 * BS)
        last_window_block = m.get_block_ids("a")[1][7]
        m.free(a)
        answers[kind].append(m.get_computed_blocks(_request("p", 8 * BS + 5))[1:])
        m.evict_blocks({last_window_block})
        answers[kind].append(m.get_computed_blocks(_request("p", 8 * BS + 5))[1:])
        answers[kind].append(m.get_computed_blocks(_request("q", 8 * BS + 5), 5 * BS)[1:])
    assert answers["pagedkv"] == answers["vllm"]
    together, diverged, capped = answers["vllm"]
    assert together == (8 * BS, 0) and capped == (5 * BS, 0)
    assert diverged[1] == 8 * BS > diverged[0]
