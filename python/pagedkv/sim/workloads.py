"""Synthetic request workloads for the simulator: seeded, reproducible, each a `Workload`.

Every generator returns prompt and output lengths (int64 ``[R]``, both >= 1, prompt + output
<= ``max_model_len``) and Poisson arrival times (float64 ``[R]`` seconds, non-decreasing), so the
same workload replays saturated (arrivals ignored), at its own timestamps, or at another rate.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pagedkv.errors import InvalidArgumentError
from pagedkv.sim.engine import Workload
from pagedkv.sim.names import SYNTHETIC_WORKLOADS

__all__ = [
    "WORKLOAD_NAMES",
    "SHAREGPT_MEAN_PROMPT_TOKENS",
    "SHAREGPT_MEAN_OUTPUT_TOKENS",
    "ALPACA_MEAN_PROMPT_TOKENS",
    "ALPACA_MEAN_OUTPUT_TOKENS",
    "synthetic",
    "lognormal",
    "sharegpt_like",
    "alpaca_like",
    "system_prompt",
    "many_tenants",
    "with_groups",
    "make_workload",
    "describe",
]

# Dataset means reported in the vLLM paper (Kwon et al., SOSP 2023, Fig. 11).
SHAREGPT_MEAN_PROMPT_TOKENS = 161.0
SHAREGPT_MEAN_OUTPUT_TOKENS = 338.0
ALPACA_MEAN_PROMPT_TOKENS = 19.31
ALPACA_MEAN_OUTPUT_TOKENS = 58.45

DEFAULT_ARRIVAL_RATE_PER_S = 10.0

WORKLOAD_NAMES = SYNTHETIC_WORKLOADS


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise InvalidArgumentError(message)


def _poisson_arrivals_s(rng: np.random.Generator, num_requests: int, rate_per_s: float) -> np.ndarray:
    """float64 [num_requests]: cumulative exponential gaps, first arrival at 0 s."""
    _require(rate_per_s > 0, f"arrival rate must be > 0 requests/s, got {rate_per_s}")
    gaps_s = rng.exponential(1.0 / rate_per_s, size=num_requests)
    gaps_s[0] = 0.0
    return np.cumsum(gaps_s)


def _check_common(num_requests: int, max_model_len: int) -> None:
    _require(
        isinstance(num_requests, (int, np.integer)) and num_requests >= 1,
        f"num_requests must be an integer >= 1, got {num_requests!r}",
    )
    _require(
        isinstance(max_model_len, (int, np.integer)) and max_model_len >= 2,
        f"max_model_len must be an integer >= 2, got {max_model_len!r}",
    )


def synthetic(
    num_requests: int = 1000,
    *,
    seed: int = 0,
    max_model_len: int = 2048,
    long_fraction: float = 0.1,
    arrival_rate_per_s: float = DEFAULT_ARRIVAL_RATE_PER_S,
) -> Workload:
    """The textbook case: mostly short generations with a few long ones.

    Prompts are uniform in [32, 512] tokens. A share ``long_fraction`` of the requests generate
    256..1024 tokens, the rest 8..64 -- the shape of real code-completion traffic (most answers
    are a line or two, a few are whole functions), where reserving for the worst case wastes most
    of the memory. Lengths are scaled down proportionally when ``max_model_len`` < 1536.
    """
    _check_common(num_requests, max_model_len)
    _require(0.0 <= long_fraction <= 1.0, f"long_fraction must be in [0, 1], got {long_fraction}")
    rng = np.random.default_rng(seed)
    scale = min(1.0, max_model_len / 1536.0)
    prompt = rng.integers(32, 513, size=num_requests)
    is_long = rng.random(num_requests) < long_fraction
    output = np.where(
        is_long, rng.integers(256, 1025, size=num_requests), rng.integers(8, 65, size=num_requests)
    )
    prompt = np.maximum(1, np.floor(prompt * scale)).astype(np.int64)
    output = np.maximum(1, np.floor(output * scale)).astype(np.int64)
    output = np.minimum(output, max_model_len - prompt)
    return Workload(
        name=f"synthetic(n={num_requests}, seed={seed})",
        prompt_tokens=prompt,
        output_tokens=output,
        arrival_s=_poisson_arrivals_s(rng, num_requests, arrival_rate_per_s),
    )


MAX_SIGMA = 100.0  # exp(100 * z) already spans every length; larger spreads overflow the fit


def _lognormal_lengths(z: np.ndarray, mean_tokens: float, sigma: float, cap: np.ndarray | int) -> np.ndarray:
    """int64 lengths exp(mu + sigma*z), rounded, clipped to [1, cap], whose mean is mean_tokens.

    mu starts at the untruncated log-normal value and is corrected by a few fixed-point steps,
    so that the mean survives the rounding and the clipping to the model length (for reachable
    targets) instead of drifting down with the clipped tail.
    """
    mu = np.log(mean_tokens) - sigma * sigma / 2.0
    lengths = np.ones_like(z, dtype=np.int64)
    for _ in range(40):
        lengths = np.clip(np.rint(np.exp(mu + sigma * z)), 1, cap).astype(np.int64)
        achieved = float(lengths.mean())
        if abs(achieved - mean_tokens) <= 1e-3 * mean_tokens:
            break
        mu += np.log(mean_tokens / achieved)
    return lengths


def lognormal(
    num_requests: int = 1000,
    *,
    prompt_mean_tokens: float,
    output_mean_tokens: float,
    prompt_sigma: float = 1.0,
    output_sigma: float = 1.0,
    seed: int = 0,
    max_model_len: int = 2048,
    arrival_rate_per_s: float = DEFAULT_ARRIVAL_RATE_PER_S,
    name: str | None = None,
) -> Workload:
    """Log-normal prompt and output lengths with the given means (tokens) and spreads.

    ``*_sigma`` is the standard deviation of the underlying normal (the log of the length): 0 gives
    every request the mean, 1 gives the heavy right tail of real chat traffic. Prompts are capped
    at ``max_model_len - 1`` and outputs at what is left of ``max_model_len``; the sample means
    still equal the requested ones (within 0.1 %) whenever that is reachable under the caps.
    """
    _check_common(num_requests, max_model_len)
    _require(
        prompt_mean_tokens >= 1 and output_mean_tokens >= 1,
        f"mean lengths must be >= 1 token, got prompt {prompt_mean_tokens}, output {output_mean_tokens}",
    )
    _require(
        prompt_sigma >= 0 and output_sigma >= 0,
        f"spreads must be >= 0, got prompt {prompt_sigma}, output {output_sigma}",
    )
    # Past this the log-normal's own parameters overflow (sigma**2 / 2 or the mean's log), and the
    # lengths would come out as NaN cast to int64.
    _require(
        max(prompt_sigma, output_sigma) <= MAX_SIGMA,
        f"spreads must be <= {MAX_SIGMA}, got prompt {prompt_sigma}, output {output_sigma}",
    )
    _require(
        np.isfinite(prompt_mean_tokens) and np.isfinite(output_mean_tokens),
        f"mean lengths must be finite, got prompt {prompt_mean_tokens}, output {output_mean_tokens}",
    )
    rng = np.random.default_rng(seed)
    z_prompt = rng.standard_normal(num_requests)
    z_output = rng.standard_normal(num_requests)
    prompt = _lognormal_lengths(z_prompt, prompt_mean_tokens, prompt_sigma, max_model_len - 1)
    output = _lognormal_lengths(z_output, output_mean_tokens, output_sigma, max_model_len - prompt)
    label = name or (
        f"lognormal(n={num_requests}, prompt {prompt_mean_tokens:g}/{prompt_sigma:g}, "
        f"output {output_mean_tokens:g}/{output_sigma:g}, seed={seed})"
    )
    return Workload(
        name=label,
        prompt_tokens=prompt,
        output_tokens=output,
        arrival_s=_poisson_arrivals_s(rng, num_requests, arrival_rate_per_s),
    )


def sharegpt_like(
    num_requests: int = 1000,
    *,
    seed: int = 0,
    max_model_len: int = 2048,
    arrival_rate_per_s: float = DEFAULT_ARRIVAL_RATE_PER_S,
) -> Workload:
    """ShareGPT-like conversation lengths: means 161 prompt / 338 output tokens (vLLM Fig. 11).

    Spreads: prompts sigma 1.0 (a long tail of pasted documents), outputs sigma 0.8 (answers are
    rarely a single token but seldom a whole page).
    """
    return lognormal(
        num_requests,
        prompt_mean_tokens=SHAREGPT_MEAN_PROMPT_TOKENS,
        output_mean_tokens=SHAREGPT_MEAN_OUTPUT_TOKENS,
        prompt_sigma=1.0,
        output_sigma=0.8,
        seed=seed,
        max_model_len=max_model_len,
        arrival_rate_per_s=arrival_rate_per_s,
        name=f"sharegpt-like(n={num_requests}, seed={seed})",
    )


def alpaca_like(
    num_requests: int = 1000,
    *,
    seed: int = 0,
    max_model_len: int = 2048,
    arrival_rate_per_s: float = DEFAULT_ARRIVAL_RATE_PER_S,
) -> Workload:
    """Alpaca-like instruction lengths: means 19.31 prompt / 58.45 output tokens (vLLM Fig. 11)."""
    return lognormal(
        num_requests,
        prompt_mean_tokens=ALPACA_MEAN_PROMPT_TOKENS,
        output_mean_tokens=ALPACA_MEAN_OUTPUT_TOKENS,
        prompt_sigma=0.6,
        output_sigma=0.8,
        seed=seed,
        max_model_len=max_model_len,
        arrival_rate_per_s=arrival_rate_per_s,
        name=f"alpaca-like(n={num_requests}, seed={seed})",
    )


def system_prompt(
    num_requests: int = 1000,
    *,
    num_system_prompts: int = 16,
    system_prompt_tokens: int = 1024,
    suffix_tokens: tuple[int, int] = (100, 500),
    output_tokens: tuple[int, int] = (16, 256),
    seed: int = 0,
    max_model_len: int = 2048,
    arrival_rate_per_s: float = DEFAULT_ARRIVAL_RATE_PER_S,
) -> Workload:
    """A chat service: each request is one of ``num_system_prompts`` shared system prompts of
    ``system_prompt_tokens`` tokens followed by a unique user suffix (uniform in ``suffix_tokens``,
    inclusive) and generates a uniform ``output_tokens`` answer.

    ``prefix_id`` names the system prompt (uniformly chosen) and ``prefix_tokens`` its length, so
    a prefix-caching run can give requests with the same id identical leading token ids.
    """
    _check_common(num_requests, max_model_len)
    _require(num_system_prompts >= 1, f"num_system_prompts must be >= 1, got {num_system_prompts}")
    _require(system_prompt_tokens >= 1, f"system_prompt_tokens must be >= 1, got {system_prompt_tokens}")
    lo_suffix, hi_suffix = suffix_tokens
    lo_out, hi_out = output_tokens
    _require(1 <= lo_suffix <= hi_suffix, f"suffix_tokens must be 1 <= lo <= hi, got {suffix_tokens}")
    _require(1 <= lo_out <= hi_out, f"output_tokens must be 1 <= lo <= hi, got {output_tokens}")
    _require(
        system_prompt_tokens + hi_suffix + hi_out <= max_model_len,
        f"system prompt {system_prompt_tokens} + suffix up to {hi_suffix} + output up to {hi_out} "
        f"tokens exceeds max_model_len {max_model_len}",
    )
    rng = np.random.default_rng(seed)
    prefix_id = rng.integers(0, num_system_prompts, size=num_requests).astype(np.int64)
    suffix = rng.integers(lo_suffix, hi_suffix + 1, size=num_requests)
    output = rng.integers(lo_out, hi_out + 1, size=num_requests).astype(np.int64)
    return Workload(
        name=(
            f"system-prompt(n={num_requests}, {num_system_prompts} x {system_prompt_tokens} tokens, "
            f"seed={seed})"
        ),
        prompt_tokens=(system_prompt_tokens + suffix).astype(np.int64),
        output_tokens=output,
        arrival_s=_poisson_arrivals_s(rng, num_requests, arrival_rate_per_s),
        prefix_id=prefix_id,
        prefix_tokens=np.full(num_requests, system_prompt_tokens, dtype=np.int64),
    )


def many_tenants(
    num_requests: int = 2000,
    *,
    num_tenants: int = 64,
    tasks_per_tenant: int = 4,
    tenant_prompt_blocks: tuple[int, int] = (4, 16),
    task_blocks: tuple[int, int] = (1, 4),
    suffix_tokens: tuple[int, int] = (16, 256),
    output_tokens: tuple[int, int] = (16, 256),
    zipf_exponent: float = 1.1,
    block_tokens: int = 64,
    seed: int = 0,
    max_model_len: int = 2048,
    arrival_rate_per_s: float = DEFAULT_ARRIVAL_RATE_PER_S,
) -> Workload:
    """A service shared by many tenants: each tenant has its own system prompt (uniform in
    ``tenant_prompt_blocks`` blocks of ``block_tokens`` tokens) and ``tasks_per_tenant`` task
    templates below it (``task_blocks`` more blocks each). A request picks a tenant by Zipf
    popularity (``zipf_exponent``: a few tenants are busy, most are not), one of its tasks
    uniformly, and adds a suffix of its own (uniform in ``suffix_tokens``); it generates a uniform
    ``output_tokens`` answer. Arrivals are Poisson.

    The prompts are chains of trace blocks (``Workload.block_ids``): the tenant's blocks, then the
    task's, then tokens of the request's own, so the shared prefixes form a two-level tree: a
    pool too small for every tenant's prompts rewards an admission order that groups them.
    """
    _check_common(num_requests, max_model_len)
    _require(num_tenants >= 1 and tasks_per_tenant >= 1, "need num_tenants >= 1 and tasks_per_tenant >= 1")
    for label, (lo, hi) in (
        ("tenant_prompt_blocks", tenant_prompt_blocks),
        ("task_blocks", task_blocks),
        ("suffix_tokens", suffix_tokens),
        ("output_tokens", output_tokens),
    ):
        _require(1 <= lo <= hi, f"{label} must be 1 <= lo <= hi, got {(lo, hi)}")
    _require(block_tokens >= 1, f"block_tokens must be >= 1, got {block_tokens}")
    _require(zipf_exponent >= 0, f"zipf_exponent must be >= 0, got {zipf_exponent}")
    longest = (tenant_prompt_blocks[1] + task_blocks[1]) * block_tokens + suffix_tokens[1] + output_tokens[1]
    _require(
        longest <= max_model_len,
        f"the longest request ({longest} tokens: tenant prompt, task, suffix and output) exceeds "
        f"max_model_len {max_model_len}",
    )
    rng = np.random.default_rng(seed)
    tenant_len = rng.integers(tenant_prompt_blocks[0], tenant_prompt_blocks[1] + 1, size=num_tenants)
    task_len = rng.integers(task_blocks[0], task_blocks[1] + 1, size=(num_tenants, tasks_per_tenant))
    # Block ids: each tenant's prompt blocks, then each of its tasks' blocks, numbered in order.
    tenant_first = np.concatenate([[0], np.cumsum(tenant_len)[:-1]])
    task_first = int(tenant_len.sum()) + np.concatenate([[0], np.cumsum(task_len.ravel())[:-1]]).reshape(
        task_len.shape
    )
    popularity = 1.0 / np.arange(1, num_tenants + 1) ** zipf_exponent
    tenant = rng.choice(num_tenants, size=num_requests, p=popularity / popularity.sum())
    task = rng.integers(0, tasks_per_tenant, size=num_requests)
    suffix = rng.integers(suffix_tokens[0], suffix_tokens[1] + 1, size=num_requests)
    output = rng.integers(output_tokens[0], output_tokens[1] + 1, size=num_requests).astype(np.int64)
    shared = tenant_len[tenant] + task_len[tenant, task]
    offsets = np.concatenate([[0], np.cumsum(shared)]).astype(np.int64)
    ids = np.concatenate(
        [
            np.concatenate(
                [
                    np.arange(tenant_first[t], tenant_first[t] + tenant_len[t]),
                    np.arange(task_first[t, k], task_first[t, k] + task_len[t, k]),
                ]
            )
            for t, k in zip(tenant.tolist(), task.tolist(), strict=True)
        ]
    ).astype(np.int64)
    return Workload(
        name=f"many-tenants(n={num_requests}, {num_tenants} tenants x {tasks_per_tenant} tasks, seed={seed})",
        prompt_tokens=(shared * block_tokens + suffix).astype(np.int64),
        output_tokens=output,
        arrival_s=_poisson_arrivals_s(rng, num_requests, arrival_rate_per_s),
        block_offsets=offsets,
        block_ids=ids,
        block_tokens=block_tokens,
    )


def with_groups(workload: Workload, group_size: int, kind: str) -> Workload:
    """The same requests, each now a group: ``kind="parallel"`` samples ``group_size`` outputs
    from one prompt, ``kind="beam"`` runs beam search of width ``group_size``. The group's
    sequences fork from the prompt and share its blocks copy-on-write."""
    _require(kind in ("parallel", "beam"), f"group kind must be 'parallel' or 'beam', got {kind!r}")
    _require(
        isinstance(group_size, (int, np.integer)) and group_size >= 1,
        f"group size must be an integer >= 1, got {group_size!r}",
    )
    num_requests = len(workload.prompt_tokens)
    return dataclasses.replace(
        workload,
        name=f"{workload.name} x {kind} {group_size}",
        group_size=np.full(num_requests, group_size, dtype=np.int64),
        group_kind=kind,
    )


def make_workload(
    name: str,
    *,
    num_requests: int | None = None,
    seed: int = 0,
    max_model_len: int = 2048,
    arrival_rate_per_s: float = DEFAULT_ARRIVAL_RATE_PER_S,
    prompt_mean_tokens: float | None = None,
    output_mean_tokens: float | None = None,
    prompt_sigma: float = 1.0,
    output_sigma: float = 1.0,
) -> Workload:
    """Build a named synthetic workload (one of ``WORKLOAD_NAMES``); the CLI's ``--workload``."""
    count = 1000 if num_requests is None else num_requests
    if name == "synthetic":
        return synthetic(count, seed=seed, max_model_len=max_model_len, arrival_rate_per_s=arrival_rate_per_s)
    if name == "sharegpt":
        return sharegpt_like(
            count, seed=seed, max_model_len=max_model_len, arrival_rate_per_s=arrival_rate_per_s
        )
    if name == "alpaca":
        return alpaca_like(
            count, seed=seed, max_model_len=max_model_len, arrival_rate_per_s=arrival_rate_per_s
        )
    if name == "system-prompt":
        return system_prompt(
            count, seed=seed, max_model_len=max_model_len, arrival_rate_per_s=arrival_rate_per_s
        )
    if name == "many-tenants":
        return many_tenants(
            count, seed=seed, max_model_len=max_model_len, arrival_rate_per_s=arrival_rate_per_s
        )
    if name == "lognormal":
        return lognormal(
            count,
            prompt_mean_tokens=SHAREGPT_MEAN_PROMPT_TOKENS
            if prompt_mean_tokens is None
            else prompt_mean_tokens,
            output_mean_tokens=SHAREGPT_MEAN_OUTPUT_TOKENS
            if output_mean_tokens is None
            else output_mean_tokens,
            prompt_sigma=prompt_sigma,
            output_sigma=output_sigma,
            seed=seed,
            max_model_len=max_model_len,
            arrival_rate_per_s=arrival_rate_per_s,
        )
    raise InvalidArgumentError(
        f"unknown workload {name!r}: expected one of {', '.join(WORKLOAD_NAMES)} or the path of a .csv trace"
    )


def describe(workload: Workload) -> dict:
    """JSON-ready summary: request count, length means and percentiles, arrival span."""
    prompt = np.asarray(workload.prompt_tokens)
    output = np.asarray(workload.output_tokens)
    arrival = np.asarray(workload.arrival_s)
    summary = {
        "name": workload.name,
        "requests": int(prompt.size),
        "prompt_tokens_mean": float(prompt.mean()),
        "prompt_tokens_p50": float(np.percentile(prompt, 50)),
        "prompt_tokens_p99": float(np.percentile(prompt, 99)),
        "output_tokens_mean": float(output.mean()),
        "output_tokens_p50": float(np.percentile(output, 50)),
        "output_tokens_p99": float(np.percentile(output, 99)),
        "arrival_span_s": float(arrival[-1] - arrival[0]) if arrival.size else 0.0,
        "group_kind": workload.group_kind,
    }
    if workload.group_size is not None:
        summary["group_size_max"] = int(np.max(workload.group_size))
    if workload.prefix_id is not None:
        summary["distinct_prefixes"] = int(np.unique(workload.prefix_id[workload.prefix_id >= 0]).size)
    if workload.block_ids is not None:
        ids = np.asarray(workload.block_ids)
        summary["prefix_block_tokens"] = int(workload.block_tokens)
        summary["prefix_blocks"] = int(ids.size)
        summary["distinct_prefix_blocks"] = int(np.unique(ids).size)
    return summary
