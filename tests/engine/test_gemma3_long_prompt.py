"""``LLM("gemma3")`` as is runs a 2,325-token prompt. The engine's default
pool is sized in bytes (``EngineConfig.kv_cache_bytes``: room for a few full-context sequences)
and its blocks are allocated per scheduled chunk, so a sliding-window group never holds more
than its window plus the chunk in flight; before, the engine reserved the whole prompt in every
KV group and refused it ("need 876 blocks over 6 KV groups; the pool has 512"). A few generated
tokens keep the test to one long prefill."""

from __future__ import annotations

import pytest

PROMPT_TOKENS = 2325


@pytest.mark.slow
def test_gemma3_runs_a_2325_token_prompt_with_the_default_config(gemma3):
    from pagedkv.engine import LLM, SamplingParams
    from pagedkv.engine.kv_budget import DEFAULT_FULL_CONTEXTS, full_context_blocks

    text = "The quick brown fox jumps over the lazy dog while the sun sets behind the hills. "
    ids = gemma3.tokenizer.encode(text * 200)[:PROMPT_TOKENS]
    assert len(ids) == PROMPT_TOKENS
    llm = LLM(gemma3)
    out = llm.generate(ids, SamplingParams(max_tokens=2, ignore_eos=True))[0]
    engine = llm.last_engine
    assert engine is not None and out.outputs[0].finish_reason == "length"
    assert len(out.outputs[0].token_ids) == 2 and engine.stats.failed_requests == 0
    # The default pool: DEFAULT_FULL_CONTEXTS sequences at the full 32 K context, each window
    # group at what it holds per chunk, in bytes of the layout's blocks.
    c = engine.config
    per_seq = full_context_blocks(engine.layout, c.block_size, engine.max_model_len, c.max_num_batched_tokens)
    assert c.num_blocks == DEFAULT_FULL_CONTEXTS * per_seq
    assert engine.kv_cache_bytes == c.num_blocks * engine.store.bytes_per_block
    # Per chunk: the most blocks the request held at once is the full group's prompt plus each
    # window group's window and chunk, far below the whole prompt in all six groups.
    window_cap = -(-(512 - 1 + c.max_num_batched_tokens) // c.block_size) + 1
    assert max(engine.stats.blocks_in_use) <= -(-(PROMPT_TOKENS + 2) // 16) + 5 * window_cap
    assert len(engine.kv) == 0 and engine.kv.num_free_blocks == c.num_blocks
