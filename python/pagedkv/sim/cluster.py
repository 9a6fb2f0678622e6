"""Cache-aware routing across replicas: N engines, each with its own ``KvCacheManager`` and prefix
cache, behind a router that knows only what the replicas' KV-event streams tell it.

A request (`traces.TraceRequest`) is a list of prefix-block ids in the Mooncake trace format
(``hash_ids``: chained ids, ``TRACE_BLOCK_TOKENS`` tokens each, the last one possibly partial).
Block id ``h`` stands for the token ids ``h * 512 + [0, 512)`` (deterministic, distinct per
block), so two requests share exactly the tokens their id lists share; the replicas hash those
tokens like any prompt.

The router indexes events the way Dynamo's KV router does (`pagedkv.sim.router_index`): a
request's match on a replica is the number of its leading blocks the replica has announced in
its KV events and not yet removed. Trace reading is `pagedkv.sim.traces`.

Time model (one replica): prefill runs one request at a time at ``prefill_tokens_per_s`` for the
tokens the prefix cache did not cover; decode is batched and takes ``decode_s_per_token`` per
output token after the first; a request holds its KV blocks (prompt + output) from the start of
its prefill to its last token. A request that does not fit waits for running ones to finish.
TTFT = queueing delay + prefill time (+ the load from a shared tier, below). Events reach the
router as soon as a replica admits a request (a replica's queue can make that earlier than the
admission's simulated time: the router sees an optimistic, equally timely view under every
cache-aware policy).

Shared tier (optional, `pagedkv.sim.shared_tier`): the blocks each replica evicts (its
``BlockRemoved`` events) go to one LRU store bounded in bytes (``block_size`` x the KV bytes of a
token of ``costmodel.LLAMA3_8B`` per block); a request's prefix comes from its replica's cache,
then from the tier (loaded, not prefilled: the load time precedes the prefill on the replica's
prefill slot), then is computed. Routing ignores the tier (every replica reaches it alike).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import pagedkv
from pagedkv.errors import InvalidArgumentError
from pagedkv.sim.costmodel import LLAMA3_8B
from pagedkv.sim.names import PREFIX_TRACES
from pagedkv.sim.router_index import EventIndex, request_keys
from pagedkv.sim.shared_tier import SharedTier, SharedTierConfig
from pagedkv.sim.traces import TRACE_BLOCK_TOKENS, TraceRequest, known_trace_path, read_mooncake_jsonl
from pagedkv.sim.workloads import system_prompt

__all__ = [
    "TRACE_BLOCK_TOKENS",
    "DEFAULT_NUM_SLOTS",
    "deployment_num_slots",
    "POLICIES",
    "WORKLOADS",
    "TraceRequest",
    "ClusterConfig",
    "SharedTierConfig",
    "load_requests",
    "block_tokens",
    "ideal_hit_rate",
    "simulate_cluster",
    "sweep",
]

POLICIES = ("round-robin", "least-loaded", "longest-prefix", "cost")
WORKLOADS = (*PREFIX_TRACES, "system-prompt", "multi-turn")


# -- the default deployment: Llama-3-8B (bf16) on one H200 per replica ----------------------------
H200_HBM_BYTES = 141e9
"""An H200's HBM3e (141 GB)."""
GPU_MEMORY_UTILIZATION = 0.9
"""vLLM's default ``gpu_memory_utilization``: the share of HBM the engine may use."""
LLAMA3_8B_PARAMS = 8_030_261_248
"""Llama-3-8B's parameter count (weights in bf16: 16.06 GB)."""
ACTIVATION_RESERVE_BYTES = 2e9
"""Peak activations and CUDA graphs of an 8B model's forward pass (vLLM profiles a few GB)."""


def deployment_num_slots(block_size: int = TRACE_BLOCK_TOKENS) -> int:
    """KV token slots of one replica: Llama-3-8B in bf16 (``costmodel.LLAMA3_8B``, 128 KiB of KV
    per token) on one H200, whatever vLLM leaves for the KV cache at its default memory
    utilization after the weights and activations, in whole blocks of ``block_size``.

    (0.9 x 141 GB - 16.06 GB weights - 2 GB activations) / 131,072 B = 830,379 tokens; in blocks
    of 512: 829,952 slots."""
    weights = LLAMA3_8B_PARAMS * LLAMA3_8B.dtype_bytes
    budget = H200_HBM_BYTES * GPU_MEMORY_UTILIZATION - weights - ACTIVATION_RESERVE_BYTES
    tokens = int(budget // LLAMA3_8B.kv_bytes_per_token)
    return tokens // block_size * block_size


DEFAULT_NUM_SLOTS = deployment_num_slots()
"""829,952: the default KV slots per replica (``deployment_num_slots``)."""


@dataclass(frozen=True)
class ClusterConfig:
    """Per-replica engine and cost model.

    num_slots: KV token slots per replica (``num_slots // block_size`` blocks); the default is
        one H200 serving Llama-3-8B (``deployment_num_slots``).
    block_size: tokens per KV block (a divisor of 512 keeps trace blocks whole).
    prefill_tokens_per_s: prefill throughput of one replica on uncached prompt tokens.
    decode_s_per_token: time per output token after the first (batched decode).
    prefill_overhead_s: fixed cost of a prefill (scheduling, one forward pass).
    """

    num_slots: int = DEFAULT_NUM_SLOTS
    block_size: int = 512
    prefill_tokens_per_s: float = 20_000.0
    decode_s_per_token: float = 0.03
    prefill_overhead_s: float = 0.02

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.num_slots < self.block_size:
            raise InvalidArgumentError("need block_size >= 1 and num_slots >= block_size")
        if not (
            self.prefill_tokens_per_s > 0 and self.decode_s_per_token >= 0 and self.prefill_overhead_s >= 0
        ):
            raise InvalidArgumentError("cost model rates must be finite and positive (times >= 0)")


# -- workloads ------------------------------------------------------------------------------------
def _system_prompt(seed: int, num_requests: int = 4000, rate_per_s: float = 8.0) -> list[TraceRequest]:
    """The simulator's one system-prompt workload (`workloads.system_prompt`) as prefix blocks:
    8 system prompts of 4 trace blocks (2,048 tokens), each request adding 1 to 1,536 tokens of
    its own; Poisson arrivals. System prompt ``p`` is blocks ``4p .. 4p+3``; a request's own
    blocks get fresh ids, so requests share exactly their system prompt."""
    prompt_blocks = 4
    workload = system_prompt(
        num_requests,
        num_system_prompts=8,
        system_prompt_tokens=prompt_blocks * TRACE_BLOCK_TOKENS,
        suffix_tokens=(1, 3 * TRACE_BLOCK_TOKENS),
        output_tokens=(50, 400),
        seed=seed,
        max_model_len=(prompt_blocks + 3) * TRACE_BLOCK_TOKENS + 400,
        arrival_rate_per_s=rate_per_s,
    )
    assert workload.prefix_id is not None
    next_id, out = 8 * prompt_blocks, []
    for arrival, prompt, output, prefix in zip(
        workload.arrival_s.tolist(),
        workload.prompt_tokens.tolist(),
        workload.output_tokens.tolist(),
        workload.prefix_id.tolist(),
        strict=True,
    ):
        own = -(-prompt // TRACE_BLOCK_TOKENS) - prompt_blocks
        ids = tuple(range(prefix * prompt_blocks, (prefix + 1) * prompt_blocks)) + tuple(
            range(next_id, next_id + own)
        )
        next_id += own
        out.append(TraceRequest(arrival, prompt, output, ids))
    return out


def _multi_turn(seed: int, num_conversations: int = 600, rate_per_s: float = 1.0) -> list[TraceRequest]:
    """Chats: 2-8 turns each; turn k's prompt is the whole history plus 1-2 new blocks; turns
    are 5-60 s apart; conversations start as a Poisson process."""
    rng = random.Random(seed)
    next_id, start, out = 0, 0.0, []
    for _ in range(num_conversations):
        start += rng.expovariate(rate_per_s)
        history: tuple[int, ...] = ()
        t = start
        for _turn in range(rng.randint(2, 8)):
            new = rng.randint(1, 2)
            history = history + tuple(range(next_id, next_id + new))
            next_id += new
            tokens = (len(history) - 1) * TRACE_BLOCK_TOKENS + rng.randint(1, TRACE_BLOCK_TOKENS)
            out.append(TraceRequest(t, tokens, rng.randint(50, 400), history))
            t += rng.uniform(5.0, 60.0)
    out.sort(key=lambda r: r.arrival_s)
    return out


def load_requests(workload: str, *, seed: int = 0, max_requests: int | None = None) -> list[TraceRequest]:
    """A named workload (``WORKLOADS``) or a Mooncake-format ``.jsonl`` (or ``.jsonl.gz``) path,
    in arrival order. The Mooncake traces ship in the package (`traces.known_trace_path`)."""
    if workload in PREFIX_TRACES:
        requests = read_mooncake_jsonl(known_trace_path(workload))
    elif workload == "system-prompt":
        requests = _system_prompt(seed)
    elif workload == "multi-turn":
        requests = _multi_turn(seed)
    elif workload.endswith((".jsonl", ".jsonl.gz")):
        requests = read_mooncake_jsonl(workload)
    else:
        raise InvalidArgumentError(
            f"unknown workload {workload!r}: one of {', '.join(WORKLOADS)} or a .jsonl path"
        )
    return requests[:max_requests] if max_requests else requests


def block_tokens(request: TraceRequest) -> np.ndarray:
    """The request's prompt token ids (uint32): block id ``h`` is ``h * 512 + [0, 512)``."""
    ids = np.asarray(request.hash_ids, dtype=np.uint32)
    tokens = (ids[:, None] * TRACE_BLOCK_TOKENS + np.arange(TRACE_BLOCK_TOKENS, dtype=np.uint32)).ravel()
    return tokens[: request.input_tokens]


def ideal_hit_rate(requests: Sequence[TraceRequest], block_size: int) -> float:
    """Token hit rate of an infinite, never-evicting prefix cache, from the ``hash_ids`` alone:
    a request hits its longest run of leading full KV blocks whose tokens an earlier request
    already held in full blocks (KV blocks of ``block_size``, a divisor of 512)."""
    if TRACE_BLOCK_TOKENS % block_size:
        raise InvalidArgumentError("ideal_hit_rate needs a block_size that divides 512")
    per_trace_block = TRACE_BLOCK_TOKENS // block_size
    seen: set[tuple[int, int]] = set()  # (trace block id, KV block within it) held in full
    hits = total = 0
    for request in requests:
        full = request.input_tokens // block_size
        keys = [(request.hash_ids[i // per_trace_block], i % per_trace_block) for i in range(full)]
        matched = 0
        while matched < full and keys[matched] in seen:
            matched += 1
        # pagedkv, like vLLM, always computes the last prompt token: a fully cached prompt
        # that ends on a block boundary recomputes its last block.
        if matched == full and full * block_size == request.input_tokens and matched:
            matched -= 1
        hits += matched * block_size
        total += request.input_tokens
        seen.update(keys)
    return hits / total if total else 0.0


# -- replicas and the simulation ------------------------------------------------------------------
@dataclass
class _Replica:
    kv: pagedkv.KvCacheManager
    prefill_free_s: float = 0.0
    running: list[tuple[float, int]] = field(default_factory=list)  # (finish_s, seq_id) heap
    work_tokens: int = 0

    def release_until(self, now_s: float) -> None:
        while self.running and self.running[0][0] <= now_s:
            self.kv.free(heapq.heappop(self.running)[1])


def _choose(
    policy: str,
    number: int,
    keys: list[int],
    input_tokens: int,
    indexes: list[EventIndex],
    active: list[list[tuple[float, int]]],
    inflight_blocks: list[int],
    block_size: int,
) -> int:
    n = len(indexes)
    if policy == "round-robin":
        return number % n
    loads = [len(a) for a in active]
    if policy == "least-loaded":
        return min(range(n), key=lambda r: (loads[r], r))
    matches = [index.match(keys) for index in indexes]
    if policy == "longest-prefix":
        # llm-d's scoring: the prefix scorer (share of the prompt's blocks matched) weighed
        # against a load scorer so one hot prefix cannot pull every request onto one replica;
        # weights 3 : 2 (this simulator's choice). The load is the KV blocks in flight (as
        # llm-d's KV-cache-utilization scorer reads it), 1 - blocks / the busiest's blocks:
        # counting requests instead ignores that one 30k-token request outweighs ten short ones
        # (the same prefill saved, a worse load balance: docs/experiments.md, Cache-aware routing).
        prompt_blocks = max(1, -(-input_tokens // block_size))
        busiest = max(inflight_blocks) or 1
        scores = [
            3.0 * matches[r] / prompt_blocks + 2.0 * (1.0 - inflight_blocks[r] / busiest) for r in range(n)
        ]
        return min(range(n), key=lambda r: (-scores[r], r))
    # Dynamo's cost: prefill blocks still to compute plus the blocks of requests in flight.
    prompt_blocks = -(-input_tokens // block_size)
    costs = [prompt_blocks - matches[r] + inflight_blocks[r] for r in range(n)]
    return min(range(n), key=lambda r: (costs[r], r))


def simulate_cluster(
    requests: Sequence[TraceRequest],
    replicas: int,
    policy: str,
    config: ClusterConfig = ClusterConfig(),
    *,
    shared_tier: SharedTierConfig | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Routes and serves ``requests`` on ``replicas`` engines (with ``shared_tier``, a store
    they all spill evicted blocks to and load prefixes from); returns one result row."""
    if policy not in POLICIES:
        raise InvalidArgumentError(f"unknown policy {policy!r}: one of {', '.join(POLICIES)}")
    if replicas < 1:
        raise InvalidArgumentError("replicas must be >= 1")
    bs = config.block_size
    num_blocks = config.num_slots // bs
    engines = [
        _Replica(
            pagedkv.KvCacheManager(
                num_blocks, bs, enable_prefix_caching=True, enable_kv_events=True, max_events=1 << 30
            )
        )
        for _ in range(replicas)
    ]
    indexes = [EventIndex(bs) for _ in range(replicas)]
    # The router's own bookkeeping of requests in flight: (finish_s, kv blocks) heaps, and
    # the blocks they hold per replica.
    active: list[list[tuple[float, int]]] = [[] for _ in range(replicas)]
    inflight_blocks = [0] * replicas
    tier = None if shared_tier is None else SharedTier(shared_tier, bs * LLAMA3_8B.kv_bytes_per_token)
    hit_tokens = prompt_tokens = rejected = predicted_tokens = shared_tokens = 0
    load_s: list[float] = []
    queue_s: list[float] = []
    ttft_s: list[float] = []
    per_replica_requests = [0] * replicas
    for number, request in enumerate(requests):
        now = request.arrival_s
        for r, flights in enumerate(active):
            while flights and flights[0][0] <= now:
                inflight_blocks[r] -= heapq.heappop(flights)[1]
        tokens = block_tokens(request)
        keys = request_keys(tokens, bs)
        target = _choose(policy, number, keys, request.input_tokens, indexes, active, inflight_blocks, bs)
        engine = engines[target]
        # What the router expects the replica to serve from cache (the last prompt token is
        # always computed, so a fully cached prompt on a block boundary recomputes a block).
        predicted = indexes[target].match(keys)
        if predicted and predicted * bs == request.input_tokens:
            predicted -= 1
        start = max(now, engine.prefill_free_s)
        engine.release_until(start)
        # Admit only when the whole request (prompt + output) fits, counting cached blocks as
        # free: a failed attempt would store blocks and make its own retry look like a hit.
        need = -(-(request.input_tokens + request.output_tokens) // bs)
        while engine.kv.num_free_blocks < need and engine.running:
            finish, seq = heapq.heappop(engine.running)
            engine.kv.free(seq)
            start = max(start, finish)
        cached = None
        if need <= engine.kv.num_free_blocks:
            cached = engine.kv.add_sequence(number, tokens)
            if request.output_tokens:
                engine.kv.append_tokens(number, num_tokens=request.output_tokens)
        # The shared tier serves what follows the local hit before this request's own
        # evictions reach it (the engine looks the prefix up before it allocates).
        loaded, load = (0, 0.0)
        if tier is not None and cached is not None:
            loaded, load = tier.serve(keys, cached // bs, request.input_tokens, bs)
        removed = indexes[target].apply(engine.kv.take_event_digests())
        if tier is not None:
            for key in removed:
                tier.put(key)
        if cached is None:
            rejected += 1  # larger than the replica's whole pool
            continue
        computed = request.input_tokens - cached - loaded
        first_token = start + config.prefill_overhead_s + load + computed / config.prefill_tokens_per_s
        finish = first_token + max(0, request.output_tokens - 1) * config.decode_s_per_token
        engine.prefill_free_s = first_token
        heapq.heappush(engine.running, (finish, number))
        blocks = -(-(request.input_tokens + request.output_tokens) // bs)
        heapq.heappush(active[target], (finish, blocks))
        inflight_blocks[target] += blocks
        engine.work_tokens += computed + request.output_tokens
        per_replica_requests[target] += 1
        hit_tokens += cached
        shared_tokens += loaded
        load_s.append(load)
        predicted_tokens += predicted * bs
        prompt_tokens += request.input_tokens
        queue_s.append(start - now)
        ttft_s.append(first_token - now)
        if progress is not None:
            progress(number + 1)
    for engine in engines:
        engine.kv.check_invariants()
    if tier is not None:
        tier.check_invariants()
    saved = hit_tokens + shared_tokens
    work = [e.work_tokens for e in engines]
    mean_work = sum(work) / replicas
    served = len(ttft_s)
    return {
        "policy": policy,
        "replicas": replicas,
        "requests": served,
        "rejected_requests": rejected,
        "token_hit_rate": saved / prompt_tokens if prompt_tokens else 0.0,
        "local_hit_rate": hit_tokens / prompt_tokens if prompt_tokens else 0.0,
        "shared_hit_rate": shared_tokens / prompt_tokens if prompt_tokens else 0.0,
        "prompt_tokens": prompt_tokens,
        "prefill_tokens": prompt_tokens - saved,
        "prefill_tokens_saved": saved,
        "local_hit_tokens": hit_tokens,
        "shared_hit_tokens": shared_tokens,
        "shared_tier": shared_tier is not None,
        "shared_tier_bytes": None if shared_tier is None else shared_tier.capacity_bytes,  # None: unbounded
        "shared_tier_loaded_bytes": 0 if tier is None else tier.loaded_blocks * tier.bytes_per_block,
        "shared_tier_evicted_blocks": 0 if tier is None else tier.evicted_blocks,
        "mean_load_s": float(np.mean(load_s)) if served else 0.0,
        "router_predicted_hit_tokens": predicted_tokens,
        "load_max_over_mean": max(work) / mean_work if mean_work else 1.0,
        "requests_max_over_mean": max(per_replica_requests) * replicas / served if served else 1.0,
        "mean_queue_s": float(np.mean(queue_s)) if served else 0.0,
        "mean_ttft_s": float(np.mean(ttft_s)) if served else 0.0,
        "p99_ttft_s": float(np.percentile(ttft_s, 99)) if served else 0.0,
    }


def sweep(
    requests: Sequence[TraceRequest],
    replica_counts: Sequence[int],
    policies: Sequence[str],
    config: ClusterConfig = ClusterConfig(),
    *,
    shared_tier: SharedTierConfig | None = None,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """One row per (policy, replicas), policies outermost."""
    rows = []
    for policy in policies:
        for n in replica_counts:
            row = simulate_cluster(requests, n, policy, config, shared_tier=shared_tier)
            rows.append(row)
            if on_row is not None:
                on_row(row)
    return rows
