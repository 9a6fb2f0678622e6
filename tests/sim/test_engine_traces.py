"""Replays of the real Azure traces (the bundled copies, or a checkout's shared/traces)."""

from __future__ import annotations

import math

import numpy as np
from pagedkv.sim.engine import SimConfig, simulate
from pagedkv.sim.traces import known_trace_path, read_azure_csv


def test_replay_azure_conversation_trace() -> None:
    w = read_azure_csv(known_trace_path("azure-conv"))
    assert w.num_requests == 19_366
    longest = int((w.prompt_tokens + w.output_tokens).max())
    for allocator in ("paged", "contiguous-oracle"):
        config = SimConfig(allocator=allocator, num_slots=40_000, max_model_len=longest, arrival="trace")
        r = simulate(w, config)
        assert r.finished_requests == 19_366
        assert r.generated_tokens == int(w.output_tokens.sum())
        shares = r.token_states + r.reserved + r.internal_fragmentation + r.external_fragmentation + r.free
        assert math.isclose(shares, 1.0, abs_tol=1e-9)
        # The replay covers the trace's hour (plus the tail of the last requests).
        assert r.simulated_seconds >= float(w.arrival_s[-1] - w.arrival_s[0])
        assert np.all(r.latency_s > 0)


def test_paged_keeps_more_code_trace_requests_resident() -> None:
    w = read_azure_csv(known_trace_path("azure-code"))
    longest = int((w.prompt_tokens + w.output_tokens).max())
    paged = simulate(w, SimConfig(num_slots=longest * 4, max_model_len=longest))
    oracle = simulate(
        w, SimConfig(allocator="contiguous-oracle", num_slots=longest * 4, max_model_len=longest)
    )
    assert paged.finished_requests == oracle.finished_requests == w.num_requests
    assert paged.mean_resident_requests > oracle.mean_resident_requests
    assert paged.steps < oracle.steps
