"""The visualizer's workload per seed, from a ``--workload`` spec (generator name or CSV trace).

For a named generator the seed is the generator's seed. A trace has no seed of its own, so the
seed picks which ``num_requests`` consecutive requests of the trace to replay: seed 0 starts at
the first row, any other seed at a reproducibly random row. Requests longer than
``max_model_len`` cannot be served by any allocator and are left out (the count is reported).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from pagedkv.errors import InvalidArgumentError


def _is_trace_spec(spec: str) -> bool:
    from pagedkv.sim.traces import KNOWN_TRACES

    return spec.lower().endswith(".csv") or spec in KNOWN_TRACES


def _trace_path(spec: str) -> Path:
    from pagedkv.sim.traces import KNOWN_TRACES, known_trace_path

    return known_trace_path(spec) if spec in KNOWN_TRACES else Path(spec)


def trace_window(trace: Any, *, seed: int, num_requests: int, max_model_len: int) -> tuple[Any, int]:
    """``num_requests`` consecutive requests of ``trace`` (a Workload) chosen by ``seed``, without
    the ones longer than ``max_model_len``; arrivals re-based to 0. Returns (workload, dropped)."""
    total = int(np.asarray(trace.prompt_tokens).size)
    if total == 0:
        raise InvalidArgumentError(f"trace {trace.name!r} has no requests")
    count = min(num_requests, total)
    start = 0 if seed == 0 else int(np.random.default_rng(seed).integers(0, total - count + 1))
    window = slice(start, start + count)
    prompt = np.asarray(trace.prompt_tokens, dtype=np.int64)[window]
    output = np.asarray(trace.output_tokens, dtype=np.int64)[window]
    arrival = np.asarray(trace.arrival_s, dtype=np.float64)[window]
    fits = prompt + output <= max_model_len
    if not fits.any():
        raise InvalidArgumentError(
            f"trace {trace.name!r}: none of requests {start}..{start + count - 1} fits "
            f"max_model_len={max_model_len}; raise --max-model-len (and --num-slots)"
        )
    arrival = arrival[fits]
    return (
        dataclasses.replace(
            trace,
            name=f"{trace.name} requests {start}..{start + count - 1}",
            prompt_tokens=prompt[fits],
            output_tokens=output[fits],
            arrival_s=arrival - arrival[0],
            group_size=None,
            group_kind="none",
            prefix_id=None,
            prefix_tokens=None,
        ),
        int(count - fits.sum()),
    )


def workload_source(
    spec: str,
    *,
    num_requests: int,
    max_model_len: int,
    on_note: Callable[[str], None] | None = None,
) -> Callable[[int], Any]:
    """A function seed -> Workload for ``spec`` (a workload name or the path of a .csv trace)."""
    if num_requests < 1:
        raise InvalidArgumentError(f"num_requests must be >= 1, got {num_requests}")
    if _is_trace_spec(spec):
        from pagedkv.sim.traces import read_azure_csv

        trace = read_azure_csv(_trace_path(spec))

        def from_trace(seed: int) -> Any:
            workload, dropped = trace_window(
                trace, seed=seed, num_requests=num_requests, max_model_len=max_model_len
            )
            if dropped and on_note is not None:
                on_note(f"seed {seed}: left out {dropped} request(s) longer than {max_model_len} tokens")
            return workload

        return from_trace

    from pagedkv.sim.workloads import make_workload

    def generated(seed: int) -> Any:
        return make_workload(
            spec, num_requests=num_requests, seed=seed, max_model_len=max_model_len
        )

    return generated
