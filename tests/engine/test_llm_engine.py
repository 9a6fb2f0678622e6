"""The paged engine against the same model on contiguous KV, and against itself under every
scheduling variation that must not change the result (prefix caching, chunked prefill, preemption
by recompute and by swap, batching), n > 1 sampling by fork, and refused requests."""

from __future__ import annotations

import numpy as np
import pagedkv
import pytest

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "def add(a, b):"]
MAX_TOKENS = 4


def _run(smollm, prompts, params=None, **options):
    from pagedkv.engine import LLM, SamplingParams

    llm = LLM(smollm, **options)
    outs = llm.generate(prompts, params or SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    llm.last_engine.kv.check_invariants()
    return [[c.token_ids for c in o.outputs] for o in outs], llm.last_engine


def test_paged_logits_bit_identical_to_contiguous_kv(smollm):
    """One batch (two prefills, then decode steps) through paged caches and through contiguous
    per-sequence buffers: the logits are equal bit for bit on the NumPy backend."""
    from pagedkv.engine.kv_store import ContiguousKvStore, PagedKvStore

    c = smollm.config
    model = smollm.model
    prompts = [smollm.tokenizer.encode(p) for p in PROMPTS[:2]]
    kv = pagedkv.KvCacheManager(num_blocks=16, block_size=4)
    paged = PagedKvStore(c, 16, 4, backend="numpy")  # the bit-exact reference data plane
    contiguous = ContiguousKvStore(c, 32)
    for i, p in enumerate(prompts):
        kv.add_sequence(i, np.array(p))
        contiguous.add(i)
    tokens, lens = [list(p) for p in prompts], [len(p) for p in prompts]
    q_lens = list(lens)
    for _ in range(3):
        ids = [0, 1]
        tables, _ = kv.batch_block_tables(ids)
        paged.set_batch(tables, np.array(lens, np.int32), np.array(q_lens, np.int32))
        contiguous.set_batch(ids, lens, q_lens)
        flat = np.concatenate([t[n - q :] for t, n, q in zip(tokens, lens, q_lens, strict=True)])
        pos = np.concatenate([np.arange(n - q, n) for n, q in zip(lens, q_lens, strict=True)])
        last = np.cumsum(q_lens) - 1
        a = model.forward(flat, pos, paged, last)
        b = model.forward(flat, pos, contiguous, last)
        assert np.array_equal(a, b)
        nxt = [int(np.argmax(row)) for row in a]
        kv.append_tokens_batch(ids, np.array(nxt))
        for t, n in zip(tokens, nxt, strict=True):
            t.append(n)
        lens = [n + 1 for n in lens]
        q_lens = [1, 1]


def test_scheduling_variations_give_identical_greedy_tokens(smollm):
    base, _ = _run(smollm, PROMPTS, num_blocks=64, block_size=4, enable_prefix_caching=False)
    chunked, eng = _run(smollm, PROMPTS, num_blocks=64, block_size=4, max_num_batched_tokens=3)
    assert chunked == base and max(eng.stats.batch_sizes) >= 2
    # A pool so small that decoding must preempt: by recompute, then by swap to the host tier.
    tight = {"num_blocks": 5, "block_size": 4, "admission_watermark_blocks": 0}
    recompute, eng = _run(smollm, PROMPTS, **tight, preemption="recompute")
    assert recompute == base and eng.stats.recompute_preemptions > 0
    swap, eng = _run(smollm, PROMPTS, **tight, num_host_blocks=16, preemption="swap")
    assert swap == base and eng.stats.swap_preemptions > 0
    alone = [_run(smollm, [p], num_blocks=64, block_size=4)[0][0] for p in PROMPTS[:2]]
    assert alone == base[:2]


def test_prefix_cache_hits_skip_prefill_and_change_nothing(smollm):
    system = "You are a terse assistant. Answer in one word. "
    prompts = [system + "Sky colour?", system + "Grass colour?"]
    off, eng_off = _run(smollm, prompts, num_blocks=64, block_size=4, enable_prefix_caching=False)
    on, eng_on = _run(smollm, prompts, num_blocks=64, block_size=4, enable_prefix_caching=True)
    assert on == off
    # The second request shares the first's full prefix blocks; it is admitted only once they are
    # computed, then skips them.
    assert eng_on.stats.prefix_hit_tokens >= 8
    assert eng_on.stats.prefill_tokens + eng_on.stats.prefix_hit_tokens == eng_off.stats.prefill_tokens


def test_n_samples_share_prompt_blocks_and_equal_separate_seeded_runs(smollm):
    from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams

    prompt = smollm.tokenizer.encode("Once upon a time, in a land far")  # not a multiple of 4 tokens
    assert len(prompt) % 4
    params = SamplingParams(
        n=4, temperature=0.9, top_k=50, top_p=0.95, seed=11, max_tokens=3, ignore_eos=True
    )
    engine = LLMEngine(smollm, EngineConfig(num_blocks=64, block_size=4))
    rid = engine.add_request(prompt, params)
    engine.step()  # prefill, fork into 4, sample the first tokens
    seqs = engine.requests[rid].sequences
    assert len(seqs) == 4
    full_blocks = engine.kv.block_table(seqs[0].seq_id)[: len(prompt) // 4]
    assert all(engine.kv.refcount(int(b)) == 4 for b in full_blocks)
    engine.step()  # the first appends: the shared partial block is copied for 3 of the 4
    assert engine.stats.cow_copies == 3
    assert all(engine.kv.refcount(int(b)) == 4 for b in full_blocks)
    engine.kv.check_invariants()
    while engine.has_unfinished():
        engine.step()
    together = [s.output_ids for s in engine.requests[rid].sequences]
    separate = []
    for i in range(4):
        single = SamplingParams(
            temperature=0.9, top_k=50, top_p=0.95, seed=11 + i, max_tokens=3, ignore_eos=True
        )
        separate.append(_run(smollm, [prompt], single, num_blocks=64, block_size=4)[0][0][0])
    assert together == separate


def test_stop_strings_and_streaming(smollm):
    from pagedkv.engine import LLM, SamplingParams

    llm = LLM(smollm, num_blocks=32, block_size=4)
    events = list(llm.stream(["1, 2, 3, 4,"], SamplingParams(max_tokens=8, stop=("6",))))
    text = "".join(e.text for e in events)
    assert events[-1].finished and events[-1].finish_reason == "stop"
    assert "6" not in text and "5" in text


def test_refused_requests_leave_nothing_behind(smollm):
    from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(smollm, EngineConfig(num_blocks=8, block_size=4, max_model_len=16))
    with pytest.raises(pagedkv.InvalidArgumentError, match="context"):
        engine.add_request(list(range(100, 120)), SamplingParams())
    with pytest.raises(pagedkv.InvalidArgumentError, match="blocks"):
        engine.add_request(list(range(100, 110)), SamplingParams(n=8, max_tokens=5))
    with pytest.raises(pagedkv.InvalidArgumentError):
        engine.add_request([10**6], SamplingParams())
    with pytest.raises(pagedkv.InvalidArgumentError):
        SamplingParams(temperature=float("nan"))
    assert not engine.has_unfinished() and not engine.requests and len(engine.kv) == 0


def test_cli_generate_streams_and_refuses_a_bad_model_path(smollm, capsys, tmp_path, monkeypatch):
    from pagedkv.cli import main
    from pagedkv.engine import LLM

    # One timeline of the engine's events and the command's stdout writes and flushes: streaming
    # means each token's text is written and flushed before the next token is generated.
    timeline: list[tuple[str, str]] = []
    stream = LLM.stream

    def recorded_stream(self, *args, **kwargs):
        for event in stream(self, *args, **kwargs):
            timeline.append(("event", event.text))
            yield event

    class Recorder:
        def write(self, text: str) -> int:
            timeline.append(("write", text))
            return len(text)

        def flush(self) -> None:
            timeline.append(("flush", ""))

    monkeypatch.setattr(LLM, "stream", recorded_stream)
    monkeypatch.setattr("sys.stdout", Recorder())
    assert main(["generate", "The capital of France is", "--max-tokens", "3"]) == 0
    monkeypatch.undo()
    events = [i for i, (kind, _) in enumerate(timeline) if kind == "event"]
    assert len(events) == 3
    for here, after in zip(events, [*events[1:], len(timeline)], strict=True):
        text = timeline[here][1]
        assert timeline[here + 1 : here + 3] == [("write", text), ("flush", "")], timeline
        assert here + 3 <= after
    assert "Paris" in "".join(text for kind, text in timeline if kind == "write")
    assert main(["generate", "Hi", "--model", str(tmp_path / "missing.gguf")]) == 2
    assert "not found" in capsys.readouterr().err
    for bad in (["--temperature", "nan"], ["--top-k", "-1"], ["--top-p", "0"], ["--seed", "-1"]):
        # Refused before the model (here a missing file) is even looked at.
        assert main(["generate", "Hi", "--model", str(tmp_path / "missing.gguf"), *bad]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert len(err) == 1 and "not found" not in err[0], (bad, err)


@pytest.mark.parametrize("budget", [4, 5])
def test_deferred_admission_leaves_no_stale_block_trusted(smollm, budget):
    """Wrong tokens with prefix caching: A and B share 2 prompt blocks; B was admitted
    while A was still prefilling them, and trusted K/V that were never written (or a previous
    owner's): [73, 49, 30, 824] instead of the [58, 53, 50, 58] it generated alone. This prompt
    is a near-tie, so the pin follows the arithmetic: [58, 53, 50, 58] today (int8 weights, the
    CPU attention's 16-lane scores; also what fp32 weights on the NumPy reference give), [58, 50,
    30, 198] under the 8-lane scores before. On the computed-watermark contract B's hit covers
    only scheduled chunks; with a budget of 5, B is admitted in the very pass that computes A's
    last chunk and hits it (same-pass hit)."""
    from pagedkv.engine import LLM, SamplingParams

    sp = SamplingParams(max_tokens=4)
    w = list(range(100, 156))
    a = list(range(10, 18)) + list(range(30, 38))
    b = list(range(10, 18)) + list(range(50, 58))
    llm = LLM(smollm, num_blocks=16, block_size=4, max_num_batched_tokens=budget)
    together = llm.generate([w, a, b], sp)
    llm.last_engine.kv.check_invariants()
    assert together[2].outputs[0].token_ids and llm.last_engine.stats.prefix_hit_tokens == 8
    alone = LLM(smollm, num_blocks=64, block_size=4).generate([b], sp)[0]
    assert alone.outputs[0].token_ids == [58, 53, 50, 58]
    assert together[2].outputs[0].token_ids == alone.outputs[0].token_ids
