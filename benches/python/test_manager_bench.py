"""Hot paths through Python against the plain-Python textbook manager.

Operations mirror the Rust criterion benches: an allocate/free pair (add + free of a one-block
sequence), appending one token, forking a 1,000-token sequence, freeing a forked group, and
an engine-like op mix (admit, decode steps, fork, finish) in two styles: one call per
sequence, and the batch API an engine would use (one call per step).
"""

from __future__ import annotations

import random
from typing import Any

from bench_helpers import make_manager

BLOCK_SIZE = 16


def test_alloc_free_pair(benchmark: Any, record: Any, impl: str) -> None:
    kv = make_manager(impl, num_blocks=4096, block_size=BLOCK_SIZE)
    add, free = kv.add_sequence, kv.free

    def pair() -> None:
        add(1, num_tokens=BLOCK_SIZE)
        free(1)

    benchmark(pair)
    record("alloc+free pair (add+free, 1 block)", impl, 1, "pair")


def test_append_one_token(benchmark: Any, record: Any, impl: str) -> None:
    kv = make_manager(impl, num_blocks=4096, block_size=BLOCK_SIZE)
    kv.add_sequence(1, [1, 2, 3])
    append = kv.append_tokens
    calls = 1000

    def thousand_appends() -> None:
        for token in range(calls):
            append(1, [token])
        # Reset so the sequence does not grow without bound (amortized over 1,000 calls).
        kv.free(1)
        kv.add_sequence(1, [1, 2, 3])

    benchmark(thousand_appends)
    record("append_tokens(seq, [tok])", impl, calls, "call")


def test_append_one_token_count_only(benchmark: Any, record: Any, impl: str) -> None:
    kv = make_manager(impl, num_blocks=4096, block_size=BLOCK_SIZE)
    kv.add_sequence(1, num_tokens=3)
    append = kv.append_tokens
    calls = 1000

    def thousand_appends() -> None:
        for _ in range(calls):
            append(1)
        kv.free(1)
        kv.add_sequence(1, num_tokens=3)

    benchmark(thousand_appends)
    record("append_tokens(seq) (no ids)", impl, calls, "call")


def test_fork(benchmark: Any, record: Any, impl: str) -> None:
    kv = make_manager(impl, num_blocks=4096, block_size=BLOCK_SIZE)
    kv.add_sequence(0, list(range(1000)))
    fork, free = kv.fork, kv.free

    def fork_and_release() -> None:
        fork(0, 1)
        free(1)

    benchmark(fork_and_release)
    record("fork 1000-token seq (+free child)", impl, 1, "fork+free")


def test_free_forked_group(benchmark: Any, record: Any, impl: str) -> None:
    kv = make_manager(impl, num_blocks=4096, block_size=BLOCK_SIZE)
    next_id = iter(range(10**9))

    def setup() -> tuple[tuple[list[int]], dict[str, Any]]:
        parent = next(next_id)
        kv.add_sequence(parent, list(range(1000)))
        group = [parent]
        for _ in range(3):
            child = next(next_id)
            kv.fork(parent, child)
            group.append(child)
        for seq_id in group:
            kv.append_tokens(seq_id, [7])  # three copy-on-writes: private tail blocks
        return (group,), {}

    benchmark.pedantic(kv.free_batch, setup=setup, rounds=3000, warmup_rounds=50)
    record("free_batch of a 4-seq forked group", impl, 1, "group")


def _op_mix_script(seed: int, steps: int) -> list[tuple[str, Any]]:
    """An engine-like schedule: 48 running sequences; each step decodes one token for all,
    finishes and admits a few, and forks now and then. Deterministic and shared by both runs."""
    rng = random.Random(seed)
    script: list[tuple[str, Any]] = []
    running: list[int] = []
    next_id = 0
    for _ in range(48):
        script.append(("add", (next_id, [rng.randrange(32000) for _ in range(rng.randrange(50, 400))])))
        running.append(next_id)
        next_id += 1
    for _ in range(steps):
        script.append(("step", list(running)))
        for _ in range(2):
            victim = running.pop(rng.randrange(len(running)))
            script.append(("free", victim))
            prompt = [rng.randrange(32000) for _ in range(rng.randrange(50, 400))]
            script.append(("add", (next_id, prompt)))
            running.append(next_id)
            next_id += 1
        if rng.random() < 0.25:
            script.append(("fork", (rng.choice(running), next_id)))
            running.append(next_id)
            next_id += 1
    script.append(("free_all", list(running)))
    return script


_SCRIPT = _op_mix_script(seed=0, steps=60)


def _run_script(kv: Any, batched: bool, with_ids: bool = True) -> None:
    add, append, free, fork = kv.add_sequence, kv.append_tokens, kv.free, kv.fork
    for op, arg in _SCRIPT:
        if op == "step":
            if batched:
                kv.append_tokens_batch(arg)
            elif with_ids:
                for seq_id in arg:
                    append(seq_id, [5])
            else:
                for seq_id in arg:
                    append(seq_id)
        elif op == "add":
            if with_ids:
                add(arg[0], arg[1])
            else:
                add(arg[0], num_tokens=len(arg[1]))
        elif op == "free":
            free(arg)
        elif op == "fork":
            fork(*arg)
        elif batched:
            kv.free_batch(arg)
        else:
            for seq_id in arg:
                free(seq_id)


_NUM_SCRIPT_OPS = sum(len(arg) if op in ("step", "free_all") else 1 for op, arg in _SCRIPT)


def test_op_mix_batched(benchmark: Any, record: Any, impl: str) -> None:
    def run() -> None:
        kv = make_manager(impl, num_blocks=8192, block_size=BLOCK_SIZE)
        _run_script(kv, batched=True)

    benchmark(run)
    record("op mix, batch API, token-id lists", impl, _NUM_SCRIPT_OPS, "seq-op")


def test_op_mix_per_call(benchmark: Any, record: Any, impl: str) -> None:
    def run() -> None:
        kv = make_manager(impl, num_blocks=8192, block_size=BLOCK_SIZE)
        _run_script(kv, batched=False)

    benchmark(run)
    record("op mix, per-call, token-id lists", impl, _NUM_SCRIPT_OPS, "seq-op")


def test_op_mix_counts_only(benchmark: Any, record: Any, impl: str) -> None:
    """The same schedule with prompts and decode steps given as token counts (an engine using
    pagedkv as a pure allocator, prefix caching off), batch API."""

    def run() -> None:
        kv = make_manager(impl, num_blocks=8192, block_size=BLOCK_SIZE)
        _run_script(kv, batched=True, with_ids=False)

    benchmark(run)
    record("op mix, batch API, counts only", impl, _NUM_SCRIPT_OPS, "seq-op")
