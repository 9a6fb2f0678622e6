"""Simulator speed from Python, in simulated (generated) tokens per second of wall time.

Run: ``pytest benches/python/test_sim_speed.py --benchmark-enable -s``. Replays the Azure
conversation trace (19,366 requests; a seeded synthetic workload of the same size when the shared
traces are absent) under the paged allocator and the contiguous-oracle one, and compares the Rust
engine with the plain-Python reference replay (tests/sim/reference_model.py) on the same 2,000
requests, measured in the same run.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest

TESTS_SIM = Path(__file__).resolve().parents[2] / "tests" / "sim"
sys.path.insert(0, str(TESTS_SIM))

from pagedkv.sim.engine import SimConfig, Workload, simulate  # noqa: E402
from reference_model import replay_paged  # noqa: E402
from sim_helpers import find_traces_dir, load_azure, synthetic_workload  # noqa: E402

_SPEEDS: dict[str, float] = {}


def _workload() -> Workload:
    folder = find_traces_dir()
    if folder is not None and (folder / "azure_llm_2023_conv.csv").is_file():
        return load_azure(folder / "azure_llm_2023_conv.csv")
    return synthetic_workload(19_366, seed=0)


@pytest.fixture(scope="module")
def trace() -> Workload:
    return _workload()


def _config(w: Workload, allocator: str) -> SimConfig:
    longest = int((w.prompt_tokens + w.output_tokens).max())
    # A 40K-slot pool: the trace's longest request (14,089 tokens) would run alone in the paper's 15.7K.
    return SimConfig(allocator=allocator, num_slots=40_000, max_model_len=max(longest, 2048))


@pytest.mark.parametrize("allocator", ["paged", "contiguous-oracle"])
def test_replay_trace_speed(benchmark, trace: Workload, allocator: str) -> None:
    config = _config(trace, allocator)
    result = benchmark.pedantic(simulate, args=(trace, config), rounds=3, iterations=1)
    seconds = benchmark.stats.stats.mean if benchmark.stats else None
    if seconds is None:
        start = time.perf_counter()
        simulate(trace, config)
        seconds = time.perf_counter() - start
    tokens_per_s = result.generated_tokens / seconds
    benchmark.extra_info.update(
        requests=trace.num_requests, steps=result.steps, simulated_tokens_per_s=tokens_per_s
    )
    _SPEEDS[allocator] = tokens_per_s
    print(
        f"\n{trace.name} {allocator}: {trace.num_requests} requests, {result.steps} steps, "
        f"{seconds:.3f} s, {tokens_per_s / 1e6:.2f} M simulated tokens/s"
    )
    assert result.finished_requests == trace.num_requests


def test_rust_engine_vs_plain_python_reference(benchmark, trace: Workload) -> None:
    n = 2000
    w = Workload("head", trace.prompt_tokens[:n], trace.output_tokens[:n], np.zeros(n))
    config = _config(w, "paged")
    start = time.perf_counter()
    ref = replay_paged(
        w.prompt_tokens, w.output_tokens, block_size=config.block_size, num_slots=config.num_slots
    )
    python_s = time.perf_counter() - start
    result = benchmark.pedantic(simulate, args=(w, config), rounds=5, iterations=1)
    rust_s = benchmark.stats.stats.mean if benchmark.stats else python_s
    assert (result.steps, result.preemptions) == (ref.steps, ref.preemptions)
    ratio = python_s / rust_s
    benchmark.extra_info.update(python_reference_s=python_s, speedup_vs_python=ratio)
    print(
        f"\n{n} requests, {result.steps} steps: Rust engine {rust_s * 1e3:.1f} ms, "
        f"plain-Python reference {python_s * 1e3:.1f} ms ({ratio:.1f}x)"
    )
