"""Cache-aware admission in the engine (``EngineConfig.scheduling``, docs/scheduling.md): the same
shared-prefix workload under fcfs, lpm and dfs in one run, on real model compute.

The workload: ``num_systems`` system prompts, each the start of ``per_system`` requests with a few
tokens of their own, arriving interleaved (all at once: the queue is long, as on an overloaded
server) into a pool that holds little more than the running requests, fewer than the system
prompts. FCFS alternates
system prompts and recomputes each one at nearly every admission; lpm and dfs admit the requests
of the cached one together. Reported per policy: wall time, generated tokens per second, prompt
tokens computed and served from the cache, the aging bound and the most any request was passed
over; and each cache-aware policy's throughput as a ratio to FCFS's from the same run.

``policy_overhead`` measures, without a model, what the order costs per admission in the engine's
path (push with the prompt's block hashes, choice, admission, the KV events drained into the
index in Rust) against the allocator's own admission (``match_prefix`` then ``add_sequence``),
at ``waiting`` waiting requests: a ratio of two timings from one run.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import numpy as np

from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.models import LoadedModel

__all__ = ["POLICIES", "policy_overhead", "run_scheduling", "shared_prefix_workload"]

POLICIES: tuple[Literal["fcfs", "lpm", "dfs"], ...] = ("fcfs", "lpm", "dfs")


def shared_prefix_workload(
    vocab: int, seed: int, num_systems: int, per_system: int, system_tokens: int, own_tokens: int
) -> list[list[int]]:
    """Prompts in arrival order: request ``i`` starts with system prompt ``i % num_systems``."""
    rng = np.random.default_rng(seed)
    low = 100 if vocab > 200 else 1  # past a real vocabulary's special tokens
    systems = [rng.integers(low, vocab, size=system_tokens).tolist() for _ in range(num_systems)]
    return [
        systems[i % num_systems] + rng.integers(low, vocab, size=own_tokens).tolist()
        for i in range(num_systems * per_system)
    ]


def run_scheduling(
    model: LoadedModel,
    *,
    seed: int = 0,
    num_systems: int = 4,
    per_system: int = 6,
    system_tokens: int = 96,
    own_tokens: int = 8,
    max_tokens: int = 4,
    block_size: int = 16,
    max_num_seqs: int = 2,
    aging_bound: int = 2048,
    say: Any = print,
) -> dict[str, Any]:
    """The workload under every policy; the numbers as one dict."""
    prompts = shared_prefix_workload(
        model.config.vocab_size, seed, num_systems, per_system, system_tokens, own_tokens
    )
    per_request = -(-(system_tokens + own_tokens + max_tokens) // block_size)
    # The running requests' blocks and one to spare: what stays cached is what they hold, so
    # with more system prompts than running requests FCFS keeps evicting the next one it needs.
    num_blocks = max_num_seqs * per_request + 1
    result: dict[str, Any] = {
        "requests": len(prompts),
        "num_systems": num_systems,
        "system_tokens": system_tokens,
        "own_tokens": own_tokens,
        "max_tokens": max_tokens,
        "num_blocks": num_blocks,
        "block_size": block_size,
        "max_num_seqs": max_num_seqs,
    }
    tokens: dict[str, list[list[int]]] = {}
    policy: Literal["fcfs", "lpm", "dfs"]
    for policy in POLICIES:
        say(f"scheduling: {policy}")
        config = EngineConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            scheduling=policy,
            aging_bound=aging_bound,
        )
        engine = LLMEngine(model, config)
        ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
        wall = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        wall = time.perf_counter() - wall
        s = engine.stats.summary()
        tokens[policy] = [engine.output(i).outputs[0].token_ids for i in ids]
        result[policy] = {
            "wall_s": wall,
            "tokens_per_s": s["generated_tokens"] / wall,
            "prefill_tokens": s["prefill_tokens"],
            "prefix_hit_tokens": s["prefix_hit_tokens"],
            "aging_bound": s["aging_bound"],
            "max_passed_over": s["max_passed_over"],
            "steps": s["steps"],
        }
    for policy in POLICIES[1:]:
        result[f"{policy}_vs_fcfs_throughput"] = (
            result[policy]["tokens_per_s"] / result["fcfs"]["tokens_per_s"]
        )
        result[f"{policy}_vs_fcfs_prefill"] = (
            result[policy]["prefill_tokens"] / result["fcfs"]["prefill_tokens"]
        )
    result["same_tokens"] = all(tokens[p] == tokens["fcfs"] for p in POLICIES)
    return result


def policy_overhead(
    policy: str = "lpm",
    *,
    waiting: int = 1000,
    admissions: int = 2000,
    seed: int = 0,
    block_size: int = 16,
    arrival: str = "prompt",
) -> dict[str, Any]:
    """Seconds per admission of the order's calls and of the allocator's admission, one run.
    ``arrival="prompt"``: ``queue.push_prompt(id, kv, prompt)``, hashed in Rust (the engine's
    path); ``"hashes"``: ``queue.push(id, kv.prefix_block_hashes(prompt), ...)``, the hashes
    round-tripping through Python ints (the engine's path before)."""
    from pagedkv import KvCacheManager
    from pagedkv._core import CacheAwareQueue

    rng = np.random.default_rng(seed)
    systems = [rng.integers(100, 30_000, size=1024).tolist() for _ in range(16)]

    def prompt() -> list[int]:
        own = int(rng.integers(100, 500))
        return systems[int(rng.integers(16))] + rng.integers(100, 30_000, size=own).tolist()

    kv = KvCacheManager(
        num_blocks=65_536, block_size=block_size, enable_prefix_caching=True, enable_kv_events=True
    )
    queue = CacheAwareQueue(policy, 2048)
    prompts: dict[int, list[int]] = {}
    order_s = alloc_s = 0.0
    running: list[int] = []
    next_id = 0
    for step in range(waiting + admissions):
        p = prompt()
        t = time.perf_counter()
        if arrival == "prompt":
            queue.push_prompt(next_id, kv, p)
        else:
            queue.push(next_id, kv.prefix_block_hashes(p), (len(p) - 1) // block_size)
        order_s += time.perf_counter() - t if step >= waiting else 0.0
        prompts[next_id] = p
        next_id += 1
        if step < waiting:
            continue
        t = time.perf_counter()
        choice = queue.peek()
        assert choice is not None
        order_s += time.perf_counter() - t
        if len(running) >= 256:
            kv.free(running.pop(0))
        t = time.perf_counter()
        kv.match_prefix(prompts[choice])
        kv.add_sequence(choice, prompts[choice])
        alloc_s += time.perf_counter() - t
        t = time.perf_counter()
        queue.admitted(choice)
        queue.apply_manager_events(kv)
        order_s += time.perf_counter() - t
        running.append(choice)
        del prompts[choice]
    return {
        "policy": policy,
        "arrival": arrival,
        "waiting": waiting,
        "admissions": admissions,
        "order_us_per_admission": 1e6 * order_s / admissions,
        "allocator_us_per_admission": 1e6 * alloc_s / admissions,
        "order_vs_allocator": order_s / alloc_s,
    }
