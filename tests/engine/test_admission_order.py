"""Cache-aware admission in the engine (``EngineConfig(scheduling=...)``, engine/waiting_order.py,
docs/scheduling.md): the order changes, the tokens do not. The randomized schedules of
test_engine_randomized.py run every policy too, with preemption, swap, n > 1 and hybrid groups,
and check the aging bound by its definition at every admission."""

from __future__ import annotations

import numpy as np
import pytest


def test_the_config_checks_the_policy_and_the_bound():
    from pagedkv.engine import EngineConfig
    from pagedkv.errors import InvalidArgumentError

    assert EngineConfig().scheduling == "fcfs"
    assert EngineConfig(scheduling="dfs", aging_bound=0).aging_bound == 0
    with pytest.raises(InvalidArgumentError, match="scheduling"):
        EngineConfig(scheduling="sjf")
    with pytest.raises(InvalidArgumentError, match="aging_bound"):
        EngineConfig(scheduling="lpm", aging_bound=-1)
    with pytest.raises(InvalidArgumentError, match="enable_prefix_caching"):
        EngineConfig(scheduling="lpm", enable_prefix_caching=False)


def _log_admissions(engine) -> list[int]:
    """The request id of every admission from now on, in order."""
    log: list[int] = []
    admitted = engine.scheduler.order.admitted

    def logged(seq) -> None:
        log.append(seq.request.request_id)
        admitted(seq)

    engine.scheduler.order.admitted = logged
    return log


def _run(model, prompts, config, max_tokens):
    """Greedy tokens per prompt, the admission order (prompt indices) and the stats."""
    from pagedkv.engine import LLMEngine, SamplingParams

    engine = LLMEngine(model, config)
    ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
    order: list[int] = []
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            index = ids.index(seq.request.request_id)
            if index not in order:
                order.append(index)
    tokens = [engine.output(i).outputs[0].token_ids for i in ids]
    return tokens, order, engine.stats.summary()


def test_every_policy_gives_the_tokens_of_each_prompt_alone_on_smollm2(smollm):
    """Two system prompts, interleaved: FCFS alternates them, one request at a time; LPM and DFS
    admit the second request of the cached prompt first, so they compute fewer prompt tokens.
    Every request's greedy tokens are those it gets alone."""
    from pagedkv.engine import EngineConfig

    rng = np.random.default_rng(44)
    vocab = smollm.config.vocab_size
    systems = [rng.integers(100, vocab, size=32).tolist() for _ in range(2)]
    prompts = [systems[i % 2] + rng.integers(100, vocab, size=5).tolist() for i in range(4)]
    base = {"num_blocks": 6, "block_size": 8, "max_num_seqs": 1}  # one prompt cached at a time
    alone = [_run(smollm, [p], EngineConfig(**base), 3)[0][0] for p in prompts]
    runs = {
        policy: _run(smollm, prompts, EngineConfig(**base, scheduling=policy, aging_bound=8), 3)
        for policy in ("fcfs", "lpm", "dfs")
    }
    for policy, (tokens, _, _) in runs.items():
        assert tokens == alone, policy
    assert runs["fcfs"][1] == [0, 1, 2, 3]
    for policy in ("lpm", "dfs"):
        tokens, order, stats = runs[policy]
        assert order == [0, 2, 1, 3], policy
        assert stats["prefix_hit_tokens"] > runs["fcfs"][2]["prefix_hit_tokens"], policy
        assert stats["aging_bound"] == 8 and stats["max_passed_over"] == 1, (policy, stats)


def test_the_aging_bound_admits_the_oldest_after_that_many_passes(tiny):
    """One request on a prompt nobody shares waits behind a stream of requests that hit a cached
    prefix: it is admitted after exactly ``aging_bound`` of them (0: in arrival order), and the
    stats print the bound."""
    from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams

    hot = list(range(1, 17))
    for bound in (0, 1, 3):
        engine = LLMEngine(
            tiny,
            EngineConfig(num_blocks=64, block_size=4, max_num_seqs=1, scheduling="lpm", aging_bound=bound),
        )
        params = SamplingParams(max_tokens=1)
        engine.add_request(hot + [40], params)  # caches the hot prefix
        while engine.has_unfinished():
            engine.step()
        cold = engine.add_request([50 + k for k in range(8)], params)
        hot_ids = [engine.add_request(hot + [60 + k], params) for k in range(6)]
        order = _log_admissions(engine)
        while engine.has_unfinished():
            engine.step()
        assert order.index(cold) == bound, (bound, order)
        assert order[bound + 1 :] == hot_ids[bound:]
        stats = engine.stats.summary()
        assert stats["aging_bound"] == bound and stats["max_passed_over"] == bound
        if bound:
            assert stats["forced_admissions"] == 1


def test_the_benchmark_runs_every_policy_on_the_same_tokens(tiny):
    """``pagedkv bench-engine --sections scheduling`` at a tiny size: every policy's tokens equal
    FCFS's, and the cache-aware ones compute fewer prompt tokens on the shared-prefix workload."""
    from pagedkv.benchmarks.scheduling import policy_overhead, run_scheduling

    result = run_scheduling(
        tiny,
        num_systems=4,
        per_system=2,
        system_tokens=16,
        own_tokens=2,
        max_tokens=2,
        block_size=4,
        say=lambda _m: None,
    )
    assert result["same_tokens"]
    for policy in ("lpm", "dfs"):
        assert result[f"{policy}_vs_fcfs_prefill"] < 1, result
        assert result[policy]["max_passed_over"] <= result[policy]["aging_bound"] == 2048
    overhead = policy_overhead("dfs", waiting=20, admissions=30)
    assert overhead["order_us_per_admission"] > 0 and overhead["allocator_us_per_admission"] > 0
