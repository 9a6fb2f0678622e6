"""Prompt-lookup speculative decoding: the drafts, and greedy outputs identical with and without
speculation on SmolLM2 with prompts that repeat themselves (so that drafts are accepted)."""

from __future__ import annotations

import pytest


def test_drafts_continue_the_latest_longest_match():
    from pagedkv.engine.ngram_proposer import propose_ngram_drafts

    # The suffix [1, 2] occurred at 0 (followed by 3, 4) and at 4 (followed by 5, 6): the latest.
    assert propose_ngram_drafts([1, 2, 3, 4, 1, 2, 5, 6, 9, 1, 2], 3) == [5, 6, 9]
    # The longest suffix wins over a later shorter match: [7, 1, 2] at 0 beats [1, 2] at 5.
    assert propose_ngram_drafts([7, 1, 2, 8, 9, 1, 2, 4, 7, 1, 2], 2) == [8, 9]
    assert propose_ngram_drafts([1, 2, 3], 4) == []  # no earlier occurrence of any suffix
    assert propose_ngram_drafts([5, 5], 4) == [5]  # only what the context holds
    assert propose_ngram_drafts([1, 2, 1], 0) == []


@pytest.mark.parametrize("budget", [256, 3])
def test_greedy_outputs_are_identical_with_and_without_speculation(smollm, budget):
    from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams

    tok = smollm.tokenizer
    prompts = [
        tok.encode("1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,"),
        tok.encode("the cat sat on the mat. the cat sat on the mat. the cat"),
        # Drafts here are accepted half of the time: the rejected ones are truncated.
        tok.encode("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a"),
    ]
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    def run(k: int) -> tuple[list[list[int]], dict]:
        config = EngineConfig(num_blocks=64, block_size=4, speculative_ngram=k, max_num_batched_tokens=budget)
        engine = LLMEngine(smollm, config)
        ids = [engine.add_request(p, params) for p in prompts]
        while engine.has_unfinished():
            engine.step()
            engine.kv.check_invariants()
        assert engine.kv.num_free_blocks == config.num_blocks
        return [engine.output(i).outputs[0].token_ids for i in ids], engine.stats.summary()

    plain, plain_stats = run(0)
    spec, stats = run(4)
    assert spec == plain
    assert 0 < stats["accepted_tokens"] < stats["draft_tokens"] and stats["tokens_per_pass"] > 1.0
    assert stats["steps"] < plain_stats["steps"]
    assert plain_stats["draft_tokens"] == 0 and plain_stats["tokens_per_pass"] == 1.0


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_a_sequence_preempted_after_its_append_drops_the_unwritten_tokens(tiny_fp32, preemption):
    """A decoding sequence preempted after its slots were allocated this step (its last token
    and drafts "computed" in the manager, but no pass writes them): the scheduler truncates them
    before the preemption. Without that the manager and the scheduler disagreed on the
    sequence's tokens and the engine stopped making progress (InvariantViolation). Under
    per-chunk allocation the engine's own schedules reach this only in a narrow order (a
    sequence still prefilling ahead of a later-admitted decoding one, after a swap-in), so the
    preemption is made here directly, between the step's decode allocation and its pass."""
    from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
    from pagedkv.engine.scheduled_batch import ScheduledBatch

    prompts = [[60, 60, 60], [19, 49, 19, 49, 19, 49, 19, 49, 19], [43, 45, 38, 43, 45, 38, 43, 45]]
    params = SamplingParams(max_tokens=6)
    config = EngineConfig(
        num_blocks=64,
        block_size=1,
        enable_prefix_caching=False,
        num_host_blocks=68,
        preemption=preemption,
        speculative_ngram=2,
    )
    engine = LLMEngine(tiny_fp32, config)
    sched, kv = engine.scheduler, engine.kv
    ids = [engine.add_request(p, params) for p in prompts]
    engine.step()  # every prefill, and the first tokens
    sched._appended = set()
    sched._append_decode_tokens()  # this step's decode slots (and drafts), as schedule() does
    assert len(sched._appended) == 3
    victim = max(sched.running, key=lambda s: s.admitted)
    known = len(victim.token_ids) - 1
    assert kv.num_tokens(victim.seq_id) > known
    sched.preempt(victim)
    if preemption == "swap":
        assert kv.is_swapped_out(victim.seq_id)
        assert kv.num_tokens(victim.seq_id) == kv.num_computed_tokens(victim.seq_id) == known
    else:
        assert victim.seq_id not in kv
    # The step's data moves so far (the swap-out) run; the others' step is abandoned (no pass
    # ran): their appended tokens are dropped.
    engine.runner.execute(ScheduledBatch([], [], list(sched._ops)))
    sched._ops = []
    for s in sched.running:
        kv.truncate(s.seq_id, len(s.token_ids) - 1)
        s.draft_ids = []
    sched._appended = set()
    for _ in range(200):
        if not engine.has_unfinished():
            break
        engine.step()
        kv.check_invariants()
    assert not engine.has_unfinished()
    plain = LLMEngine(tiny_fp32, EngineConfig(num_blocks=64, block_size=1))
    expected = [plain.add_request(p, params) for p in prompts]
    while plain.has_unfinished():
        plain.step()
    for got, want in zip(ids, expected, strict=True):
        assert engine.output(got).outputs[0].token_ids == plain.output(want).outputs[0].token_ids
