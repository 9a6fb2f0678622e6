"""Build a workload and a `SimConfig` from named settings: what ``pagedkv simulate``, ``sweep``,
``compare``, ``recovery`` and ``viz`` share.

The command lines only parse their flags and call these with keyword arguments; a notebook calls
them the same way. Every bad value or combination is an `InvalidArgumentError` naming the setting.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from pagedkv.errors import InvalidArgumentError
from pagedkv.sim import traces, workloads
from pagedkv.sim.engine import SimConfig, Workload
from pagedkv.sim.names import PREFIX_TRACE_WORKLOADS, SYNTHETIC_WORKLOADS, TRACE_WORKLOADS, WORKLOAD_CHOICES

__all__ = [
    "SYNTHETIC_WORKLOADS",
    "TRACE_WORKLOADS",
    "WORKLOAD_CHOICES",
    "DEFAULT_MAX_MODEL_LEN",
    "is_synthetic",
    "build_workload",
    "build_config",
]

# The vLLM paper's setting (a 13B model served with at most 2,048 tokens per request).
DEFAULT_MAX_MODEL_LEN = 2048


def is_synthetic(workload: str) -> bool:
    """Whether ``workload`` names a generated workload (rather than a trace)."""
    return workload in SYNTHETIC_WORKLOADS


def build_workload(
    workload: str = "synthetic",
    *,
    num_requests: int | None = None,
    seed: int = 0,
    max_model_len: int | None = None,
    arrival_rate_per_s: float | None = None,
    prompt_mean_tokens: float | None = None,
    output_mean_tokens: float | None = None,
    prompt_sigma: float = 1.0,
    output_sigma: float = 1.0,
    parallel_samples: int | None = None,
    beam_width: int | None = None,
    on_note: Callable[[str], None] | None = None,
) -> Workload:
    """The workload named ``workload``: a synthetic name, a known trace, the path of a CSV trace,
    or a prefix-sharing trace (``mooncake-*`` or the path of a Mooncake-format ``.jsonl``).

    Synthetic workloads are generated with ``seed`` (``num_requests`` requests, default 1000, no
    request longer than ``max_model_len``, Poisson arrivals at ``arrival_rate_per_s``); a trace
    keeps its own lengths and times, cut to its first ``num_requests`` requests. Each request
    then becomes a group of ``parallel_samples`` samples or a beam search of ``beam_width``.
    ``on_note`` receives remarks for the user (the attribution of a bundled trace).
    """
    if parallel_samples and beam_width:
        raise InvalidArgumentError("parallel_samples and beam_width exclude each other")
    if is_synthetic(workload):
        result = workloads.make_workload(
            workload,
            num_requests=num_requests,
            seed=seed,
            max_model_len=max_model_len or DEFAULT_MAX_MODEL_LEN,
            arrival_rate_per_s=arrival_rate_per_s or workloads.DEFAULT_ARRIVAL_RATE_PER_S,
            prompt_mean_tokens=prompt_mean_tokens,
            output_mean_tokens=output_mean_tokens,
            prompt_sigma=prompt_sigma,
            output_sigma=output_sigma,
        )
    elif workload in PREFIX_TRACE_WORKLOADS or workload.lower().endswith((".jsonl", ".jsonl.gz")):
        known = workload in PREFIX_TRACE_WORKLOADS
        trace_path = traces.known_trace_path(workload) if known else Path(workload)
        result = traces.mooncake_workload(
            traces.read_mooncake_jsonl(trace_path), name=workload if known else trace_path.name
        )
        if known and on_note is not None:
            on_note(traces.MOONCAKE_ATTRIBUTION)
        if num_requests is not None:
            result = result.select(slice(0, num_requests))
    else:
        path: str | Path
        if workload in TRACE_WORKLOADS:
            path = traces.known_trace_path(workload)
        elif workload.lower().endswith((".csv", ".csv.gz")):
            path = workload
        else:
            raise InvalidArgumentError(
                f"workload {workload!r}: expected one of {', '.join(WORKLOAD_CHOICES)} "
                "or a path ending in .csv or .jsonl"
            )
        result = traces.read_azure_csv(path)
        if traces.is_azure_trace(path) and on_note is not None:
            on_note(traces.AZURE_ATTRIBUTION)
        if num_requests is not None:
            result = result.select(slice(0, num_requests))
    if parallel_samples:
        result = workloads.with_groups(result, parallel_samples, "parallel")
    if beam_width:
        result = workloads.with_groups(result, beam_width, "beam")
    return result


def build_config(
    workload: Workload,
    *,
    synthetic: bool,
    allocator: str = "paged",
    placement: str = "first-fit",
    block_size: int = 16,
    num_slots: int = 15_744,
    max_model_len: int | None = None,
    arrival: str = "saturated",
    poisson_rate_per_s: float | None = None,
    step_time_s: float = 0.02,
    preemption: str = "recompute",
    num_host_slots: int | None = None,
    max_num_seqs: int = 256,
    enable_prefix_caching: bool = False,
    seed: int = 0,
    max_steps: int | None = None,
    scheduling: str = "fcfs",
    aging_bound: int = 2048,
    queue_aware_eviction: bool = False,
) -> SimConfig:
    """The `SimConfig` to replay ``workload`` with.

    ``max_model_len`` defaults to 2048, or for a trace (``synthetic=False``) to its longest
    request when that is longer, so that every request of a trace can run. ``num_host_slots``
    defaults to ``num_slots`` under swap preemption and to 0 otherwise.
    """
    if max_model_len is None:
        max_model_len = DEFAULT_MAX_MODEL_LEN
        if not synthetic and workload.num_requests:
            longest = int((workload.prompt_tokens + workload.output_tokens).max())
            max_model_len = max(DEFAULT_MAX_MODEL_LEN, longest)
    if num_host_slots is None:
        num_host_slots = num_slots if preemption == "swap" else 0
    if num_host_slots < 0:
        raise InvalidArgumentError(f"num_host_slots must be >= 0, got {num_host_slots}")
    config = SimConfig(
        allocator=allocator,
        placement=placement,
        block_size=block_size,
        num_slots=num_slots,
        max_model_len=max_model_len,
        arrival=arrival,
        step_time_s=step_time_s,
        preemption=preemption,
        num_host_slots=num_host_slots,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=enable_prefix_caching,
        seed=seed,
        max_steps=max_steps,
        scheduling=scheduling,
        aging_bound=aging_bound,
        queue_aware_eviction=queue_aware_eviction,
    )
    if poisson_rate_per_s is not None:
        config = dataclasses.replace(config, poisson_rate=poisson_rate_per_s)
    return config
