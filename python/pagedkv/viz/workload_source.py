"""The visualizer's workload for each seed of the page.

A generated workload (``--workload synthetic`` ...) is simply regenerated with that seed. A trace
has no seed of its own, so the seed picks which ``--num-requests`` consecutive requests of the
trace to replay: seed 0 starts at the first row, any other seed at a reproducibly random row.
Requests longer than ``--max-model-len`` cannot be served by any allocator and are left out
(the count is reported).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from pagedkv.errors import InvalidArgumentError


def trace_window(trace: Any, *, seed: int, num_requests: int, max_model_len: int) -> tuple[Any, int]:
    """``num_requests`` consecutive requests of ``trace`` (a Workload) chosen by ``seed``, minus
    those longer than ``max_model_len``; arrivals re-based to 0 s. Returns (workload, dropped)."""
    total = int(np.asarray(trace.prompt_tokens).size)
    if total == 0:
        raise InvalidArgumentError(f"trace {trace.name!r} has no requests")
    if num_requests < 1:
        raise InvalidArgumentError(f"num_requests must be >= 1, got {num_requests}")
    count = min(num_requests, total)
    start = 0 if seed == 0 else int(np.random.default_rng(seed).integers(0, total - count + 1))
    window = slice(start, start + count)
    prompt = np.asarray(trace.prompt_tokens, dtype=np.int64)[window]
    output = np.asarray(trace.output_tokens, dtype=np.int64)[window]
    fits = prompt + output <= max_model_len
    if not fits.any():
        raise InvalidArgumentError(
            f"trace {trace.name!r}: none of requests {start}..{start + count - 1} fits "
            f"max_model_len={max_model_len}; raise --max-model-len (and --num-slots)"
        )
    rows = np.arange(start, start + count)[fits]
    workload = trace.select(rows, name=f"{trace.name} requests {start}..{start + count - 1}")
    arrival = np.asarray(workload.arrival_s, dtype=np.float64)
    workload = dataclasses.replace(workload, arrival_s=arrival - arrival[0])
    return workload, int(count - fits.sum())


def workload_for_seed(
    *,
    workload: str,
    num_requests: int,
    max_model_len: int,
    on_note: Callable[[str], None] | None = None,
    **options: Any,
) -> Callable[[int], Any]:
    """seed -> Workload, for the keyword arguments of `pagedkv.sim.builders.build_workload`.

    A generated workload is rebuilt with each seed; a trace is read once and windowed by
    `trace_window`. ``on_note`` receives remarks (requests left out, a trace's attribution).
    """
    from pagedkv.sim.builders import build_workload, is_synthetic

    options.pop("seed", None)
    if is_synthetic(workload):
        return lambda seed: build_workload(
            workload, num_requests=num_requests, max_model_len=max_model_len, seed=seed, **options
        )

    trace = build_workload(
        workload, num_requests=None, max_model_len=max_model_len, on_note=on_note, **options
    )

    def window(seed: int) -> Any:
        result, dropped = trace_window(
            trace, seed=seed, num_requests=num_requests, max_model_len=max_model_len
        )
        if dropped and on_note is not None:
            on_note(f"seed {seed}: left out {dropped} request(s) longer than {max_model_len} tokens")
        return result

    return window
