"""The engine on hybrid KV groups (``EngineConfig(hybrid_kv=True)``, the default): the tiny
random-weight hybrid Gemma (tests/engine/tiny_hybrid.py: one full-attention and two
sliding-window groups, window 8) generates the same tokens as with every layer's history kept
(``hybrid_kv=False``), while its sliding-window groups release the blocks their window has
passed and it holds fewer KV bytes. Under random schedules: test_engine_randomized.py. The
Gemma 3 270M weights: test_gemma3.py. The memory benchmark: test_bench_memory.py."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_hybrid import WINDOW
from tiny_llama import VOCAB


def _run(model, prompts, params, **options):
    """Outputs, the largest count of released (-1) sliding-window table entries seen after a
    step, and the most KV bytes in use after a step."""
    from pagedkv.engine import EngineConfig, LLMEngine

    engine = LLMEngine(model, EngineConfig(num_blocks=256, block_size=4, **options))
    ids = [engine.add_request(p, params) for p in prompts]
    released = peak_bytes = 0
    while engine.has_unfinished():
        engine.step()
        engine.kv.check_invariants()
        if engine.layout.is_hybrid:
            for g, window in enumerate(engine.layout.group_windows):
                if window is not None:
                    for seq in engine.scheduler.running:
                        table = engine.kv.block_table(seq.seq_id, group=g)
                        released = max(released, int((table < 0).sum()))
        in_use = int(engine.kv.stats()["num_blocks_in_use"])
        peak_bytes = max(peak_bytes, in_use * engine.store.bytes_per_block)
    assert engine.kv.num_free_blocks == 256
    return [engine.output(i).outputs[0].token_ids for i in ids], released, peak_bytes


@pytest.mark.parametrize("chunk", [256, 3])  # one-shot prefill, and chunks smaller than a window
def test_hybrid_groups_generate_the_all_full_tokens_and_release_blocks(tiny_hybrid, chunk):
    from pagedkv.engine import SamplingParams

    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, VOCAB, size=n).tolist() for n in (5, 19, 33)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    hybrid, released, hybrid_bytes = _run(tiny_hybrid, prompts, params, max_num_batched_tokens=chunk)
    full, none_released, full_bytes = _run(
        tiny_hybrid, prompts, params, max_num_batched_tokens=chunk, hybrid_kv=False
    )
    assert hybrid == full
    # 33 + 16 tokens with a window of 8 in blocks of 4: all but the last 3 blocks released.
    assert released >= (33 + 15 - WINDOW) // 4 - 1 and none_released == 0
    assert hybrid_bytes < full_bytes


def test_hybrid_prefix_hits_and_n_samples_equal_all_full(tiny_hybrid):
    """Prefix hits served by every group (a sliding-window group needs only the window before
    the hit point) and n > 1 forks with copy-on-write: the same tokens as all-full."""
    from pagedkv.engine import SamplingParams

    rng = np.random.default_rng(4)
    shared = rng.integers(1, VOCAB, size=24).tolist()
    prompts = [shared + rng.integers(1, VOCAB, size=3).tolist() for _ in range(3)]
    params = SamplingParams(n=2, max_tokens=10, temperature=1.0, seed=5, ignore_eos=True)
    from pagedkv.engine import EngineConfig, LLMEngine

    outs = {}
    for hybrid in (True, False):
        engine = LLMEngine(tiny_hybrid, EngineConfig(num_blocks=256, block_size=4, hybrid_kv=hybrid))
        first = engine.add_request(prompts[0], params)
        while engine.has_unfinished():
            engine.step()
        rest = [engine.add_request(p, params) for p in prompts[1:]]
        while engine.has_unfinished():
            engine.step()
            engine.kv.check_invariants()
        outs[hybrid] = [[c.token_ids for c in engine.output(r).outputs] for r in (first, *rest)]
        assert engine.stats.prefix_hit_tokens >= 2 * 24 - 8, hybrid
    assert outs[True] == outs[False]


def test_hybrid_kv_is_a_checked_bool():
    from pagedkv.engine import EngineConfig
    from pagedkv.errors import InvalidArgumentError

    assert EngineConfig().hybrid_kv is True
    with pytest.raises(InvalidArgumentError, match="hybrid_kv"):
        EngineConfig(hybrid_kv="yes")  # type: ignore[arg-type]
