"""The engine under random schedules on a tiny random-weight llama (tests/engine/tiny_llama.py)
and a tiny random-weight hybrid Gemma (tests/engine/tiny_hybrid.py: one full-attention and two
sliding-window KV groups, window 8): preemption by recompute and by swap, prefix caching on and
off, chunked and one-shot prefill, tiny pools, shared prefixes, n > 1, requests arriving while
others run. Every request's greedy tokens must equal running it alone (for the hybrid model:
alone with every layer's history kept, ``hybrid_kv=False``), ``check_invariants()`` holds
after every step, and every block is free at the end; the hybrid schedules release
out-of-window blocks (``-1`` in a sliding-window group's table) while sequences run.

A seeded generator (not Hypothesis) keeps the schedules reproducible and the test at a few
seconds; the totals asserted at the end show that the schedules reach every path above.

Quantized caches (``kv_cache_dtype``) run the same trials: int8 and fp8 quantize each token on
its own, so every schedule still equals each request alone. An int4 block is quantized when it
fills, and a token's attention reads its own block from the residual until then, so its result
depends on when blocks seal: the same for every schedule only without chunked prefill, prefix
hits (a hit block was computed in another request's chunks), recompute preemption (a prefill
recomputes what decode steps computed) and rejected drafts (a reopened block returns
dequantized); its trials exclude those and keep batching, swap preemption, forks and tiny
pools, at the trial's block size. ``test_int4_random_schedules_run_to_completion`` runs int4
through every path without comparing tokens (docs/quantized_kv.md, "int4 and the schedule")."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
from tiny_llama import VOCAB

TRIALS = 250
HYBRID_TRIALS = 150  # the hybrid model has 6 layers to the llama's 2
MAX_STEPS = 3000  # far above any trial's need: a trial that runs past it has stopped progressing


def _blocks_needed(model, prompt_len: int, params, block_size: int) -> int:
    """The engine's own bound (``Scheduler.blocks_to_fit``): pools this small must still run
    every request, so a bound below what the manager can refuse or hold stalls or fails a trial."""
    from pagedkv.engine import EngineConfig, LLMEngine

    config = EngineConfig(num_blocks=1, block_size=block_size)
    return LLMEngine(model, config).scheduler.blocks_to_fit(prompt_len, params)


def _alone(
    model, prompt: list[int], params, cache: dict, index: int = 0, kv_cache_dtype=None, block_size=4
) -> list[int]:
    """Sample ``index`` of a request run alone: a single-sample request with seed ``seed + index``,
    every layer's K/V kept for the whole context (no KV group releases anything)."""
    from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams

    seed = None if params.seed is None else params.seed + index
    single = SamplingParams(max_tokens=params.max_tokens, temperature=params.temperature, seed=seed)
    key = (tuple(prompt), single, kv_cache_dtype, block_size)
    if key not in cache:
        config = EngineConfig(
            num_blocks=64 * 4 // block_size,
            block_size=block_size,
            enable_prefix_caching=False,
            hybrid_kv=False,
            kv_cache_dtype=kv_cache_dtype,
        )
        engine = LLMEngine(model, config)
        rid = engine.add_request(prompt, single)
        while engine.has_unfinished():
            engine.step()
        cache[key] = engine.output(rid).outputs[0].token_ids
    return cache[key]


def _random_trial(rng: np.random.Generator, model, alone: dict, kv_cache_dtype=None, exact_int4=False):
    """A random config and requests; ``exact_int4``: only schedules under which an int4 cache
    gives each request's tokens alone (module docs)."""
    from pagedkv.engine import EngineConfig, SamplingParams

    bs = int(rng.choice([1, 2, 3, 4]))
    alone_bs = bs if kv_cache_dtype == "int4" else 4
    prefixes = [rng.integers(1, VOCAB, size=int(rng.integers(1, 13))).tolist() for _ in range(2)]
    requests: list[tuple[int, list[int], SamplingParams]] = []
    for _ in range(int(rng.integers(1, 7))):
        if requests and rng.random() < 0.3:
            # A follow-up turn: an earlier prompt and its answer, so that the prefix cache is hit on
            # blocks filled by decoding (and by copy-on-write copies when that request has n > 1).
            _, earlier, params = requests[int(rng.integers(len(requests)))]
            prompt = earlier + _alone(model, earlier, params, alone, 0, kv_cache_dtype, alone_bs)
        else:
            prompt = prefixes[int(rng.integers(2))] if rng.random() < 0.7 else []
        prompt = prompt + rng.integers(1, VOCAB, size=int(rng.integers(0 if prompt else 1, 8))).tolist()
        # Greedy, or sampled with a seed: the samples of an n > 1 request then differ, so that
        # each one's copy-on-write copy fills up with its own tokens.
        sampled = rng.random() < 0.4
        params = SamplingParams(
            n=int(rng.choice([1, 1, 2, 3])),
            max_tokens=int(rng.integers(1, 7)),
            temperature=1.5 if sampled else 0.0,
            seed=int(rng.integers(1000)) if sampled else None,
        )
        requests.append((int(rng.integers(0, 6)), prompt, params))  # (arrival step, prompt, params)
    need = max(_blocks_needed(model, len(p), s, bs) for _, p, s in requests)
    swap = rng.random() < 0.5
    num_blocks = need + int(rng.integers(0, 4))
    config = EngineConfig(
        num_blocks=num_blocks,
        block_size=bs,
        enable_prefix_caching=bool(rng.random() < 0.7),
        num_host_blocks=int(rng.integers(1, 2 * num_blocks)) if swap else 0,
        preemption="swap" if swap else "recompute",
        max_num_seqs=int(rng.integers(1, 7)),
        max_num_batched_tokens=int(rng.integers(1, 17)),
        enable_chunked_prefill=bool(rng.random() < 0.7),
        admission_watermark_blocks=[None, 0, 1][int(rng.integers(3))],
        speculative_ngram=[0, 0, 2, 5][int(rng.integers(4))],
        kv_cache_dtype=kv_cache_dtype,
    )
    if kv_cache_dtype == "int4":
        # A request's samples hold residual slots at once.
        max_n = max(p.n for _, _, p in requests)
        config = replace(config, max_num_seqs=max(config.max_num_seqs, max_n))
    if exact_int4:
        # Swap preemption only, with host blocks enough that a swap never falls back to recompute.
        config = replace(
            config,
            enable_prefix_caching=False,
            enable_chunked_prefill=False,
            speculative_ngram=0,
            preemption="swap",
            num_host_blocks=2 * num_blocks * max(p.n for _, _, p in requests),
        )
    return config, requests


def _released_positions(engine) -> int:
    """Table entries the sliding-window groups have released (-1) over the running sequences."""
    layout = engine.layout
    released = 0
    for g, window in enumerate(layout.group_windows):
        if window is None:
            continue
        for seq in engine.scheduler.running:
            released += int((engine.kv.block_table(seq.seq_id, group=g) < 0).sum())
    return released


def _with_scheduling(config, trial: int):
    """The trial's admission order (engine/waiting_order.py), from a generator of its own so that
    the schedules above stay those of every earlier version of this test: with prefix caching,
    one of the three policies and a small aging bound (forced admissions happen)."""
    if not config.enable_prefix_caching:
        return config
    rng = np.random.default_rng(10_000 + trial)
    policy = ("fcfs", "lpm", "dfs")[int(rng.integers(3))]
    return replace(config, scheduling=policy, aging_bound=int(rng.integers(0, 4)))


def _check_aging(engine) -> list[int]:
    """Logs the arrival rank of every admission and checks the aging bound by its definition:
    a new request's first admission comes after at most ``aging_bound`` admissions of younger
    requests (docs/scheduling.md). Returns the log."""
    order = engine.scheduler.order
    log: list[int] = []
    if order.queue is None:
        return log
    admitted = order.admitted

    def checked(seq) -> None:
        if seq.seq_id in order._queued:
            passes = sum(rank > seq.queue_rank for rank in log)
            assert passes <= engine.config.aging_bound, (passes, engine.config)
        log.append(seq.queue_rank)
        admitted(seq)

    order.admitted = checked
    return log


def _run_trial(model, config, requests) -> tuple[dict[int, list[list[int]]], dict[str, float]]:
    from pagedkv.engine import LLMEngine

    engine = LLMEngine(model, config)
    slots = [s for s in (engine.scheduler.slots, engine.scheduler.host_slots) if s is not None]
    log = _check_aging(engine)
    ids: dict[int, int] = {}
    step = 0
    released = 0
    while len(ids) < len(requests) or engine.has_unfinished():
        for i, (arrival, prompt, params) in enumerate(requests):
            if arrival == step:
                ids[i] = engine.add_request(prompt, params)
        engine.step()
        engine.kv.check_invariants()
        for s in slots:
            s.check()
        if engine.layout.is_hybrid:
            released += _released_positions(engine)
        step += 1
        assert step < MAX_STEPS, f"no progress: {config}"
    assert len(engine.kv) == 0 and engine.kv.num_free_blocks == config.num_blocks
    assert all(s.num_free == s.num_slots for s in slots)  # every residual slot released
    assert engine.stats.failed_requests == 0
    outputs = {i: [c.token_ids for c in engine.output(rid).outputs] for i, rid in ids.items()}
    # Admissions out of arrival order (a cache-aware choice, or a preempted request back first).
    reordered = sum(a > b for a, b in zip(log, log[1:], strict=False))
    summary = {**engine.stats.summary(), "released_positions": released, "reordered": reordered}
    if config.scheduling != "fcfs":
        summary[f"admissions_{config.scheduling}"] = len(log)
    return outputs, summary


@pytest.mark.parametrize(
    ("kind", "trials", "kv_cache_dtype"),
    [
        ("llama", TRIALS, None),
        ("hybrid", HYBRID_TRIALS, None),
        ("llama", 200, "int8"),
        ("hybrid", 80, "int8"),
        ("llama", 120, "fp8_e4m3"),
        ("llama", 100, "int4"),
        ("hybrid", 50, "int4"),
    ],
)
def test_random_schedules_equal_each_request_alone(kind, trials, kv_cache_dtype, tiny, tiny_hybrid):
    model = tiny if kind == "llama" else tiny_hybrid
    rng = np.random.default_rng(2026)
    alone: dict = {}
    totals: Counter[str] = Counter()
    exact_int4 = kv_cache_dtype == "int4"
    for trial in range(trials):
        config, requests = _random_trial(rng, model, alone, kv_cache_dtype, exact_int4)
        config = _with_scheduling(config, trial)
        outputs, summary = _run_trial(model, config, requests)
        for i, (_, prompt, params) in enumerate(requests):
            expected = [
                _alone(
                    model, prompt, params, alone, k, kv_cache_dtype, config.block_size if exact_int4 else 4
                )
                for k in range(params.n)
            ]
            assert outputs[i] == expected, (trial, config, i, requests)
        totals.update({k: v for k, v in summary.items() if isinstance(v, int)})
    # The hybrid schedules released out-of-window blocks (and the llama ones had nothing to release).
    assert (totals["released_positions"] > 0) == (kind == "hybrid"), totals
    # The schedules reach every path the test is about.
    paths = (
        ("swap_preemptions",)
        if exact_int4
        else ("recompute_preemptions", "swap_preemptions", "prefix_hit_tokens")
    )
    for key in paths:
        assert totals[key] > 0, (key, totals)
    assert totals["cow_copies"] > 0
    if not exact_int4:
        # Speculation ran, drafts were accepted and rejected (truncated).
        assert 0 < totals["accepted_tokens"] < totals["draft_tokens"]
    if kv_cache_dtype is None:
        # Every admission order ran, reordered admissions and hit its aging bound.
        assert totals["admissions_lpm"] > 0 and totals["admissions_dfs"] > 0, totals
        assert totals["reordered"] > 0 and totals["forced_admissions"] > 0, totals


@pytest.mark.parametrize("kind", ["llama", "hybrid"])
def test_int4_random_schedules_run_to_completion(kind, tiny, tiny_hybrid):
    """int4 through every path (chunked prefill, prefix hits, recompute and swap preemption,
    speculation with rejected drafts reopening sealed blocks, forks): invariants after every
    step, every residual slot released at the end, every request finished without an error."""
    model = tiny if kind == "llama" else tiny_hybrid
    rng = np.random.default_rng(43)
    totals: Counter[str] = Counter()
    for _ in range(80 if kind == "llama" else 40):
        config, requests = _random_trial(rng, model, {}, "int4")
        outputs, summary = _run_trial(model, config, requests)
        for i, (_, _, params) in enumerate(requests):
            assert len(outputs[i]) == params.n and all(1 <= len(t) <= params.max_tokens for t in outputs[i])
        totals.update({k: v for k, v in summary.items() if isinstance(v, int)})
    for key in ("recompute_preemptions", "swap_preemptions", "prefix_hit_tokens", "cow_copies"):
        assert totals[key] > 0, (key, totals)
    assert 0 < totals["accepted_tokens"] < totals["draft_tokens"]
    if kind == "llama":
        assert totals["residual_reopens"] > 0, totals


@pytest.mark.parametrize("kind", ["llama", "hybrid"])
@pytest.mark.parametrize("seed", [1, 2])
def test_tiny_model_tokens_depend_on_the_context(tiny, tiny_hybrid, kind, seed):
    """The check above can fail: on these models, the wrong history changes the greedy tokens
    (the two prompts differ in their first 8 tokens; for the hybrid model the first generated
    token's window of 8 reaches 3 of them, and the global layers see all)."""
    from pagedkv.engine import SamplingParams

    model = tiny if kind == "llama" else tiny_hybrid
    rng = np.random.default_rng(seed)
    suffix = rng.integers(1, VOCAB, size=4).tolist()
    params = SamplingParams(max_tokens=6)
    a = _alone(model, rng.integers(1, VOCAB, size=8).tolist() + suffix, params, {})
    b = _alone(model, rng.integers(1, VOCAB, size=8).tolist() + suffix, params, {})
    assert a != b
