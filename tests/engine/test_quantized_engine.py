"""The engine on quantized KV caches (``EngineConfig(kv_cache_dtype=...)``, docs/quantized_kv.md).

On SmolLM2-135M: a batch equals each request alone; preemption by swap changes nothing (blocks
and int4 residual slots move as they are); int8 also under chunked prefill and recompute
preemption (int4's tokens depend on when its blocks seal: tests/engine/test_engine_randomized.py
states and tests which schedules keep them); n > 1 greedy samples forked off a prefill equal
the single sample (the int4 child's residual is its parent's copy). On the tiny llama: a
rejected draft that sealed an int4 block reopens it (the planned block and token count, the
kept tokens back in the slot exactly as attention read them), and the KV memory the store
allocates is what ``engine/kv_budget.py`` counts."""

from __future__ import annotations

import numpy as np
import pytest
from pagedkv.attention.quant_codec import decode_blocks, round_trip_8bit
from pagedkv.errors import InvalidArgumentError

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "def add(a, b):"]
MAX_TOKENS = 4


def _run(model, prompts, params=None, **options):
    from pagedkv.engine import LLM, SamplingParams

    llm = LLM(model, **options)
    outs = llm.generate(prompts, params or SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    engine = llm.last_engine
    engine.kv.check_invariants()
    for slots in (engine.scheduler.slots, engine.scheduler.host_slots):
        if slots is not None:
            slots.check()
            assert slots.num_free == slots.num_slots
    return [[c.token_ids for c in o.outputs] for o in outs], engine


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_batched_alone_and_preempted_runs_agree(smollm, dtype):
    roomy = {"num_blocks": 64, "block_size": 4, "enable_prefix_caching": False, "kv_cache_dtype": dtype}
    base, _ = _run(smollm, PROMPTS, **roomy)
    assert [_run(smollm, [p], **roomy)[0][0] for p in PROMPTS] == base
    tight = {"num_blocks": 5, "block_size": 4, "admission_watermark_blocks": 0, "kv_cache_dtype": dtype}
    swap, eng = _run(smollm, PROMPTS, **tight, num_host_blocks=16, preemption="swap")
    assert swap == base and eng.stats.swap_preemptions > 0
    if dtype == "int8":  # per-token codes: chunking and recomputation change nothing either
        chunked, eng = _run(
            smollm, PROMPTS, num_blocks=64, block_size=4, max_num_batched_tokens=3, kv_cache_dtype=dtype
        )
        assert chunked == base
        recompute, eng = _run(smollm, PROMPTS, **tight, preemption="recompute")
        assert recompute == base and eng.stats.recompute_preemptions > 0


def test_forked_greedy_samples_equal_one_sample_on_int4(smollm):
    from pagedkv.engine import SamplingParams

    prompt = "Once upon a time, in a land far"
    assert len(smollm.tokenizer.encode(prompt)) % 4  # the fork shares an open block
    options = {"num_blocks": 64, "block_size": 4, "kv_cache_dtype": "int4", "max_num_seqs": 4}
    one, _ = _run(smollm, [prompt], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), **options)
    three, eng = _run(
        smollm, [prompt], SamplingParams(n=3, max_tokens=5, temperature=0.0, ignore_eos=True), **options
    )
    assert three[0] == one[0] * 3
    assert eng.stats.cow_copies > 0


def test_a_rejected_draft_reopens_the_block_it_sealed(tiny):
    """Speculation on a repetitive prompt (drafts proposed and rejected) at block size 4: every
    truncation into a block the drafts sealed is planned with that block and the kept tokens'
    count, and runs before anything else writes the slot: the slot then holds the block's
    dequantized tokens."""
    from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
    from pagedkv.engine.kv_store import PagedKvStore
    from pagedkv.engine.scheduler import Scheduler

    planned: list[tuple[int, int, tuple[int, ...]]] = []
    reopen_plan = Scheduler._reopen

    def record(self, seq, written, keep):
        before = len(self._pending)
        reopen_plan(self, seq, written, keep)
        if len(self._pending) > before:
            op = self._pending[-1]
            bs = self.config.block_size
            assert op.num_tokens == keep % bs and written >= (keep // bs + 1) * bs
            assert op.blocks == (int(self.kv.block_table(seq.seq_id)[keep // bs]),)
            planned.append((op.slot, op.num_tokens, op.blocks))

    checked = []
    reopen_data = PagedKvStore.reopen

    def check(self, slot, num_tokens, blocks):
        reopen_data(self, slot, num_tokens, blocks)
        for cache in (*self.k_caches, *self.v_caches):
            # The kept tokens' int4 values, re-quantized to int8 as every residual token is.
            want = round_trip_8bit(
                decode_blocks(cache.data[[blocks[0]]], cache.layout)[0, :num_tokens], "int8"
            )
            res = cache.residual
            got = decode_blocks(res.data[slot : slot + 1], res.layout)[0, :num_tokens]
            np.testing.assert_array_equal(got, want)
        checked.append((slot, num_tokens, tuple(blocks)))

    config = EngineConfig(num_blocks=64, block_size=4, kv_cache_dtype="int4", speculative_ngram=5)
    engine = LLMEngine(tiny, config)
    engine.scheduler._reopen = record.__get__(engine.scheduler)
    engine.store.reopen = check.__get__(engine.store)
    prompts = [[7, 8, 9, 10, 11] * 4 + [7], [3, 4, 5] * 5, [20, 21, 22, 23, 24, 25] * 3]
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=24, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
        engine.kv.check_invariants()
    assert planned and checked == planned[: len(checked)]
    assert len(planned) - len(checked) <= 1  # a reopen planned after the last step never runs
    assert engine.stats.residual_reopens == len(planned)


def test_the_store_allocates_what_the_budget_counts(tiny, tiny_hybrid):
    from pagedkv.engine import EngineConfig, LLMEngine
    from pagedkv.engine.kv_budget import blocks_for_budget, pool_block_bytes, residual_bytes_per_sequence

    for model in (tiny, tiny_hybrid):
        c = model.config
        for dtype in ("float32", "float16", "int8", "fp8_e4m3", "int4"):
            config = EngineConfig(num_blocks=40, block_size=4, kv_cache_dtype=dtype, max_num_seqs=3)
            engine = LLMEngine(model, config)
            layout = engine.layout
            per_block = pool_block_bytes(layout, 4, c.num_kv_heads, c.head_dim, dtype)
            per_seq = residual_bytes_per_sequence(layout, 4, c.num_kv_heads, c.head_dim, dtype)
            assert engine.store.bytes_per_block == per_block
            assert engine.store.kv_bytes == 40 * per_block + 3 * per_seq
            assert (per_seq > 0) == (dtype == "int4")
            budget = 40 * per_block + 3 * per_seq
            assert (
                blocks_for_budget(budget, layout, 4, c.num_kv_heads, c.head_dim, dtype, max_num_seqs=3) == 40
            )


def test_bad_kv_cache_dtypes_and_requests_are_refused(tiny):
    from pagedkv.engine import LLM, EngineConfig, LLMEngine, SamplingParams

    for bad in ("int3", "fp8", 8, "float64"):
        with pytest.raises(InvalidArgumentError, match="kv_cache_dtype"):
            EngineConfig(kv_cache_dtype=bad)
    with pytest.raises(InvalidArgumentError, match="kv_cache_dtype"):
        LLM(tiny, kv_cache_dtype="int2")
    engine = LLMEngine(tiny, EngineConfig(num_blocks=64, block_size=4, kv_cache_dtype="int4", max_num_seqs=2))
    with pytest.raises(InvalidArgumentError, match="residual slots"):
        engine.add_request([1, 2, 3], SamplingParams(n=3))
    assert not engine.has_unfinished()
