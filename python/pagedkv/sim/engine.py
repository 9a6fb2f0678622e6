"""The replay engine: continuous batching of a workload under one KV allocator.

The loop runs in Rust (``pagedkv::sim``, exposed as ``pagedkv._core.simulate``); this module
holds the Python-side types of the simulator's contract and converts arrays. The paged
allocator is the real ``KvCacheManager``; the contiguous ones place one reservation per sequence
with a first-fit or buddy allocator over one slot array. Metric definitions: docs/metrics.md.

>>> import numpy as np
>>> w = Workload("tiny", np.array([100, 200]), np.array([10, 20]), np.zeros(2))
>>> r = simulate(w, SimConfig(num_slots=1024))
>>> (r.finished_requests, r.generated_tokens, r.steps)
(2, 30, 20)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from pagedkv import _core
from pagedkv.errors import InvalidArgumentError
from pagedkv.sim.names import ALLOCATORS, PLACEMENTS
from pagedkv.sim.progress import Progress

__all__ = [
    "Workload",
    "SimConfig",
    "SimResult",
    "simulate",
    "record_frames",
    "ALLOCATORS",
    "PLACEMENTS",
]


@dataclass(frozen=True)
class Workload:
    """Requests to replay, one entry per request in every array (all of length R).

    prompt_tokens: int64 [R] prompt length (>= 1), including any shared prefix.
    output_tokens: int64 [R] tokens each sequence generates (>= 1).
    arrival_s: float64 [R] arrival time in seconds, non-decreasing (used by arrival="trace").
    group_size: int64 [R] sequences per request (n samples or beam width), or None for all 1.
    group_kind: "none" | "parallel" | "beam".
    prefix_id: int64 [R] id of a shared system prompt (-1: none), or None.
    prefix_tokens: int64 [R] length of that prefix (part of prompt_tokens), or None.
    block_offsets, block_ids: trace prefix blocks (the Mooncake format's ``hash_ids``), or None:
        int64 [R + 1] and int64 [sum of blocks]; request i's prompt is the chain of blocks
        ``block_ids[block_offsets[i]:block_offsets[i + 1]]`` of ``block_tokens`` tokens each (block
        id h stands for the tokens ``h * block_tokens + [0, block_tokens)``), so requests share
        exactly the tokens their id lists share. Not together with ``prefix_id``.
    block_tokens: tokens per trace block (default 512, the Mooncake traces').
    """

    name: str
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    arrival_s: np.ndarray
    group_size: np.ndarray | None = None
    group_kind: str = "none"
    prefix_id: np.ndarray | None = None
    prefix_tokens: np.ndarray | None = None
    block_offsets: np.ndarray | None = None
    block_ids: np.ndarray | None = None
    block_tokens: int = 512

    @property
    def num_requests(self) -> int:
        return int(np.asarray(self.prompt_tokens).shape[0])

    def select(self, indices: np.ndarray | slice, *, name: str | None = None) -> Workload:
        """The requests at ``indices`` (a slice, an index array or a boolean mask), in that order,
        every per-request column cut alike (the trace blocks too)."""
        rows = np.arange(self.num_requests)[indices]
        columns: dict[str, Any] = {
            key: np.asarray(getattr(self, key))[rows]
            for key in (
                "prompt_tokens",
                "output_tokens",
                "arrival_s",
                "group_size",
                "prefix_id",
                "prefix_tokens",
            )
            if getattr(self, key) is not None
        }
        if self.block_offsets is not None and self.block_ids is not None:
            offsets = np.asarray(self.block_offsets, dtype=np.int64)
            ids = np.asarray(self.block_ids, dtype=np.int64)
            starts, ends = offsets[rows], offsets[rows + 1]
            columns["block_ids"] = (
                np.concatenate([ids[a:b] for a, b in zip(starts.tolist(), ends.tolist(), strict=True)])
                if rows.size
                else np.zeros(0, dtype=np.int64)
            )
            columns["block_offsets"] = np.concatenate([[0], np.cumsum(ends - starts)]).astype(np.int64)
        return dataclasses.replace(self, name=name or self.name, **columns)


@dataclass(frozen=True)
class SimConfig:
    """Settings of one run; the Rust ``SimConfig`` has the same fields and defaults."""

    allocator: str = "paged"
    placement: str = "first-fit"
    block_size: int = 16
    num_slots: int = 15_744
    max_model_len: int = 2048
    arrival: str = "saturated"
    poisson_rate: float = 10.0
    step_time_s: float = 0.02
    preemption: str = "recompute"
    num_host_slots: int = 0
    max_num_seqs: int = 256
    enable_prefix_caching: bool = False
    seed: int = 0
    max_steps: int | None = None
    # Share of blocks paged admission keeps free for running requests to grow into (vLLM's 1 %).
    watermark: float = 0.01
    # Check the allocator's invariants after every step (slow; for tests).
    check_invariants: bool = False
    # Admission order: "fcfs", "lpm" or "dfs" (docs/scheduling.md; the last two need the paged
    # allocator with prefix caching and no host tier).
    scheduling: str = "fcfs"
    # Most admissions that may pass over a waiting request under "lpm" and "dfs" (0: FCFS).
    aging_bound: int = 2048
    # Queue-aware eviction (needs "lpm" or "dfs"): blocks a waiting request will hit are evicted
    # after every other cached block (docs/scheduling.md).
    queue_aware_eviction: bool = False


@dataclass
class SimResult:
    """Outcome of a run. The five shares are time averages over steps and sum to 1."""

    token_states: float
    reserved: float
    internal_fragmentation: float
    external_fragmentation: float
    free: float
    mean_resident_requests: float
    peak_resident_requests: int
    preemptions: int
    finished_requests: int
    steps: int
    generated_tokens: int
    generated_tokens_per_step: float
    waste_per_request_tokens: np.ndarray  # float64 [finished], in finishing order
    block_table_len: np.ndarray  # int64 [finished] (paged) / zeros (contiguous)
    prefix_hit_tokens: int
    prefix_query_tokens: int
    prefill_tokens: int
    swapped_blocks: int  # swapped_out_blocks + swapped_in_blocks
    bytes_moved: int  # needs a model shape: 0 here, filled in by the caller's cost model
    simulated_seconds: float
    num_slots: int = 0
    mean_running_sequences: float = 0.0
    mean_used_blocks: float = 0.0
    recompute_preemptions: int = 0
    swap_preemptions: int = 0
    recomputed_tokens: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    finished_request_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # Steps at which some request waited for admission, and the five shares averaged over those
    # steps only (the memory picture while memory, or the batch cap, is the bottleneck).
    queued_steps: int = 0
    shares_while_queued: dict[str, float] = field(default_factory=dict)
    latency_s: np.ndarray = field(default_factory=lambda: np.zeros(0))  # float64 [finished]
    # Arrival to first admission, per finished request (same order as latency_s).
    wait_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    # Prompt tokens of the admitted requests at their first admission, and those the cache served.
    prompt_tokens: int = 0
    prompt_hit_tokens: int = 0
    # The offline optimum (pagedkv_sim::optimal_hits; 0 without prefix caching): the workload's
    # prompt tokens and the most of them any admission order serves from the cache.
    optimal_prompt_tokens: int = 0
    optimal_hit_tokens: int = 0
    scheduling: str = "fcfs"
    aging_bound: int = 0
    max_passed_over: int = 0
    forced_admissions: int = 0
    evicted_wanted_blocks: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    @property
    def token_hit_rate(self) -> float:
        """Share of the admitted requests' prompt tokens served from the cache at first admission."""
        return self.prompt_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def optimal_token_hit_rate(self) -> float:
        """The offline optimum's share of the workload's prompt tokens (docs/scheduling.md)."""
        return self.optimal_hit_tokens / self.optimal_prompt_tokens if self.optimal_prompt_tokens else 0.0

    @property
    def hit_rate_of_optimum(self) -> float:
        """``token_hit_rate / optimal_token_hit_rate`` (1 when the optimum is 0)."""
        best = self.optimal_token_hit_rate
        return self.token_hit_rate / best if best else 1.0

    @property
    def p99_wait_s(self) -> float:
        """99th percentile of the finished requests' waits for admission (0 if none finished)."""
        return float(np.percentile(self.wait_s, 99)) if len(self.wait_s) else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: arrays become lists; includes every key listed in docs/design.md, Command line
        and result files."""
        out: dict[str, Any] = {}
        for key, value in asdict(self).items():
            if isinstance(value, np.ndarray):
                out[key] = value.tolist()
            elif isinstance(value, np.generic):
                out[key] = value.item()
            else:
                out[key] = value
        out["prefix_hit_rate"] = self.prefix_hit_rate
        out["token_hit_rate"] = self.token_hit_rate
        out["optimal_token_hit_rate"] = self.optimal_token_hit_rate
        out["hit_rate_of_optimum"] = self.hit_rate_of_optimum
        out["mean_wait_s"] = float(np.mean(self.wait_s)) if len(self.wait_s) else 0.0
        out["p99_wait_s"] = self.p99_wait_s
        return out


def _int_column(name: str, values: Any, length: int | None) -> np.ndarray:
    """A 1-D int64 copy of `values`; floats are accepted only when integral; masked arrays are
    refused (their masked entries have no defined value)."""
    if isinstance(values, np.ma.MaskedArray):
        raise InvalidArgumentError(f"{name} is a masked array: pass a plain array or list")
    array = np.asarray(values)
    if array.ndim != 1:
        raise InvalidArgumentError(f"{name} must be 1-D, got shape {array.shape}")
    if length is not None and array.shape[0] != length:
        raise InvalidArgumentError(
            f"{name} has {array.shape[0]} entries but prompt_tokens has {length}; one per request"
        )
    if array.dtype.kind in "iu":
        if array.dtype.kind == "u" and array.size and int(array.max()) > np.iinfo(np.int64).max:
            raise InvalidArgumentError(f"{name} has values beyond int64")
        return np.ascontiguousarray(array, dtype=np.int64)
    if array.dtype.kind == "f":
        bad = ~np.isfinite(array) | (array != np.round(array))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise InvalidArgumentError(f"request {i}: {name} is {array[i].item()!r}, not an integer")
        return np.ascontiguousarray(array, dtype=np.int64)
    if array.dtype.kind == "b" or array.size:
        raise InvalidArgumentError(f"{name} must hold integers, got dtype {array.dtype}")
    return np.zeros(0, dtype=np.int64)


# prompt, output, arrival, group_size, group_kind, prefix_id, prefix_tokens: `_core.simulate`'s order.
_Columns = tuple[
    np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, str, np.ndarray | None, np.ndarray | None
]


def _columns(workload: Workload) -> _Columns:
    if not isinstance(workload, Workload):
        raise InvalidArgumentError(
            f"workload must be a pagedkv.sim.engine.Workload, got {type(workload).__name__}"
        )
    prompt = _int_column("prompt_tokens", workload.prompt_tokens, None)
    n = prompt.shape[0]
    output = _int_column("output_tokens", workload.output_tokens, n)
    if isinstance(workload.arrival_s, np.ma.MaskedArray):
        raise InvalidArgumentError("arrival_s is a masked array: pass a plain array or list")
    arrival = np.asarray(workload.arrival_s)
    if arrival.ndim != 1 or arrival.shape[0] != n:
        raise InvalidArgumentError(f"arrival_s must be 1-D with {n} entries, got shape {arrival.shape}")
    if arrival.dtype.kind not in "iuf":
        raise InvalidArgumentError(f"arrival_s must hold numbers, got dtype {arrival.dtype}")
    arrival = np.ascontiguousarray(arrival, dtype=np.float64)
    opt = lambda name, v: None if v is None else _int_column(name, v, n)  # noqa: E731
    return (
        prompt,
        output,
        arrival,
        opt("group_size", workload.group_size),
        str(workload.group_kind),
        opt("prefix_id", workload.prefix_id),
        opt("prefix_tokens", workload.prefix_tokens),
    )


def _block_kwargs(workload: Workload) -> dict[str, Any]:
    """The trace prefix blocks as `_core.simulate`'s keyword arguments (none when absent)."""
    if workload.block_offsets is None and workload.block_ids is None:
        return {}
    if workload.block_offsets is None or workload.block_ids is None:
        raise InvalidArgumentError("block_offsets and block_ids must be given together")
    tokens = workload.block_tokens
    if isinstance(tokens, bool) or not isinstance(tokens, (int, np.integer)) or tokens < 1:
        raise InvalidArgumentError(f"block_tokens must be an int >= 1, got {tokens!r}")
    return {
        "block_tokens": int(tokens),
        "block_offsets": _int_column("block_offsets", workload.block_offsets, None),
        "block_ids": _int_column("block_ids", workload.block_ids, None),
    }


def _config_dict(config: SimConfig) -> dict[str, Any]:
    if not isinstance(config, SimConfig):
        raise InvalidArgumentError(
            f"config must be a pagedkv.sim.engine.SimConfig, got {type(config).__name__}"
        )
    d = asdict(config)
    for key in ("poisson_rate", "step_time_s", "watermark"):
        value = d[key]
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            d[key] = float(value)
    for key, value in d.items():
        if isinstance(value, np.integer):
            d[key] = int(value)
        elif isinstance(value, np.floating):
            d[key] = float(value)
        elif isinstance(value, np.bool_):
            d[key] = bool(value)
    return d


def _result(raw: dict[str, Any]) -> SimResult:
    steps = int(raw["steps"])
    return SimResult(
        token_states=raw["token_states"],
        reserved=raw["reserved"],
        internal_fragmentation=raw["internal_fragmentation"],
        external_fragmentation=raw["external_fragmentation"],
        free=raw["free"],
        mean_resident_requests=raw["mean_resident_requests"],
        peak_resident_requests=raw["peak_resident_requests"],
        preemptions=raw["preemptions"],
        finished_requests=raw["finished_requests"],
        steps=steps,
        generated_tokens=raw["generated_tokens"],
        generated_tokens_per_step=raw["generated_tokens"] / steps if steps else 0.0,
        waste_per_request_tokens=raw["waste_per_request_tokens"],
        block_table_len=raw["block_table_len"],
        prefix_hit_tokens=raw["prefix_hit_tokens"],
        prefix_query_tokens=raw["prefix_query_tokens"],
        prefill_tokens=raw["prefill_tokens"],
        swapped_blocks=raw["swapped_out_blocks"] + raw["swapped_in_blocks"],
        bytes_moved=0,
        simulated_seconds=raw["simulated_seconds"],
        num_slots=raw["num_slots"],
        mean_running_sequences=raw["mean_running_sequences"],
        mean_used_blocks=raw["mean_used_blocks"],
        recompute_preemptions=raw["recompute_preemptions"],
        swap_preemptions=raw["swap_preemptions"],
        recomputed_tokens=raw["recomputed_tokens"],
        swapped_out_blocks=raw["swapped_out_blocks"],
        swapped_in_blocks=raw["swapped_in_blocks"],
        finished_request_ids=raw["finished_request_ids"],
        queued_steps=raw["queued_steps"],
        shares_while_queued=raw["shares_while_queued"],
        latency_s=raw["latency_s"],
        wait_s=raw["wait_s"],
        prompt_tokens=raw["prompt_tokens"],
        prompt_hit_tokens=raw["prompt_hit_tokens"],
        optimal_prompt_tokens=raw["optimal_prompt_tokens"],
        optimal_hit_tokens=raw["optimal_hit_tokens"],
        scheduling=raw["scheduling"],
        aging_bound=raw["aging_bound"],
        max_passed_over=raw["max_passed_over"],
        forced_admissions=raw["forced_admissions"],
        evicted_wanted_blocks=raw["evicted_wanted_blocks"],
    )


def _progress_callback(bar: Progress) -> Any:
    """The Rust loop's progress hook ``(steps, finished, total) -> keep going`` drawing ``bar``."""

    def on_progress(steps: int, finished: int, total: int) -> bool:
        bar.total = max(int(total), 1)
        bar.update_to(finished, f"requests, {steps} steps")
        return True

    return on_progress


def simulate(workload: Workload, config: SimConfig, *, progress: bool = False) -> SimResult:
    """Replays `workload` under `config`; raises InvalidArgumentError on malformed input (the
    message names the request index or the setting)."""
    columns = _columns(workload)
    config_dict = _config_dict(config)
    with Progress(
        workload.num_requests, f"simulate {workload.name} {config.allocator}", enabled=progress
    ) as bar:
        raw = _core.simulate(
            *columns, config_dict, _progress_callback(bar) if progress else None, **_block_kwargs(workload)
        )
    return _result(raw)


def record_frames(workload: Workload, config: SimConfig, *, max_steps: int = 400) -> dict[str, Any]:
    """The first `max_steps` steps of a run, frame by frame, for the visualizer.

    Returns ``{"config", "allocator", "num_blocks", "block_size", "num_slots", "summary",
    "frames"}``. ``num_blocks`` is the number of pool cells: blocks (paged) or groups of
    ``block_size`` slots (contiguous). Each frame holds ``step``, ``time_s``, ``running``,
    ``waiting``, ``finished``, ``preemptions`` (cumulative), ``used_blocks`` (cells with an
    owner), ``token_slots``, ``reserved_slots`` (allocated, to be filled),
    ``internal_frag_slots``, ``external_frag_slots``, ``free_slots``, ``waste_pct`` (slots
    neither holding a token nor free, in percent of the pool: the tables' ``waste`` per step),
    ``pool`` (int64 array ``[num_blocks, 3]``: per cell
    ``[owner_request_id or -1, tokens_held, reserved_not_yet_used]``; ``.tolist()`` for JSON),
    ``tables`` (``{request_id: {"blocks": [...], "num_tokens": n}}`` for the request's first
    sequence, plus ``"sequences"`` listing every sequence of a group) and ``shared``
    (``[block_id, refcount]`` of blocks shared by several sequences).
    """
    if isinstance(max_steps, bool) or not isinstance(max_steps, (int, np.integer)) or max_steps < 1:
        raise InvalidArgumentError(f"max_steps must be a positive int, got {max_steps!r}")
    columns = _columns(workload)
    config_dict = _config_dict(config)
    raw = _core.record_frames(*columns, config_dict, int(max_steps), **_block_kwargs(workload))
    frames = raw.pop("frames")
    summary = _result(raw).to_dict()
    paged = config.allocator == "paged"
    num_cells = (
        config.num_slots // config.block_size if paged else math.ceil(config.num_slots / config.block_size)
    )
    return {
        "config": asdict(config),
        "workload": workload.name,
        "allocator": config.allocator,
        "num_blocks": num_cells,
        "block_size": config.block_size,
        "num_slots": config.num_slots,
        "summary": summary,
        "frames": frames,
    }
