"""``pagedkv bench-engine --sections memory``: KV bytes in use with hybrid KV groups against every
layer full attention, read from the manager's block accounting, equal the block counts that
vLLM's window rule gives (full groups hold every block; a sliding-window group holds the blocks
from the first one not wholly before ``computed - window + 1``), and Gemma 3 270M at 8 K context
holds at most 25 % of the all-full bytes (the command: tests/cli/test_bench_memory_cli.py)."""

from __future__ import annotations


def _expected_blocks(context: int, block_size: int, windows) -> int:
    """Blocks of one sequence at ``context`` tokens (its last token just appended: the release
    ran with ``context - 1`` tokens computed), summed over the groups."""
    total = -(-context // block_size)
    return sum(total if w is None else total - max(0, context - w) // block_size for w in windows)


def test_memory_section_counts_the_window_rule_on_the_tiny_hybrid_model(tiny_hybrid):
    from pagedkv.benchmarks.memory import kv_memory

    c = tiny_hybrid.config  # 2 global + 4 local layers of window 8: 3 groups of 2 layers
    budget = 256 * 2 * 2 * 4 * 2 * 8 * 4  # 256 hybrid blocks of 4 tokens (2 layers, 2 heads of 8)
    m = kv_memory(c, contexts=(6, 40, 100), block_size=4, budget_bytes=budget)
    h, f = m["hybrid"], m["all_full"]
    assert h["kv_groups"] == ["full", "window 8", "window 8"] and h["layers_per_group"] == 2
    assert f["kv_groups"] == ["full"] and f["layers_per_group"] == 6
    assert f["bytes_per_block"] == 3 * h["bytes_per_block"] == 6 * 2 * 4 * 2 * 8 * 4
    for context in (6, 40, 100):
        hc, fc = h["contexts"][str(context)], f["contexts"][str(context)]
        assert hc["blocks_in_use"] == _expected_blocks(context, 4, (None, 8, 8))
        assert fc["blocks_in_use"] == _expected_blocks(context, 4, (None,))
        assert m["ratio"][str(context)] == hc["kv_bytes_in_use"] / fc["kv_bytes_in_use"]
        # The all-full pool holds whole sequences; each holds ceil(context / 4) blocks.
        assert fc["batch_admitted"] == fc["budget_blocks"] // -(-context // 4)
    # Below the window nothing is released: the same bytes either way.
    assert m["ratio"]["6"] == 1.0
    assert m["ratio"]["100"] < 0.5
    assert h["contexts"]["100"]["batch_admitted"] > f["contexts"]["100"]["batch_admitted"]


def test_memory_section_counts_what_the_engine_holds(tiny_hybrid):
    """The section's replay (prompt of C - 1 tokens, then the first generated token appended)
    holds the blocks the engine holds after its first decode step on the same prompt length,
    in both layouts: it measures the engine's allocation, not a model of it."""
    import numpy as np
    from pagedkv.benchmarks.memory import kv_memory
    from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams

    context = 40
    m = kv_memory(tiny_hybrid.config, contexts=(context,), block_size=4, budget_bytes=1 << 20)
    prompt = np.random.default_rng(0).integers(1, 96, size=context - 1).tolist()
    for hybrid, key in ((True, "hybrid"), (False, "all_full")):
        config = EngineConfig(num_blocks=128, block_size=4, max_num_batched_tokens=512, hybrid_kv=hybrid)
        engine = LLMEngine(tiny_hybrid, config)
        engine.add_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True))
        engine.step()  # the prefill and the first token
        engine.step()  # the first decode step: the token appended, the window released
        assert engine.kv.num_tokens(0) == context
        in_use = engine.kv.stats()["num_blocks_in_use"]
        assert in_use == m[key]["contexts"][str(context)]["blocks_in_use"], key
        assert in_use * engine.store.bytes_per_block == m[key]["contexts"][str(context)]["kv_bytes_in_use"]
