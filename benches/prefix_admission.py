"""Prefix admission through Python, as a new user calls it: W2-style prompts (a 1,024-token
cached system prompt + a 300-token unique suffix = 1,324 tokens, block size 16) admitted and
freed, against the same call with prefix caching off, and an all-miss prompt, in one run;
the same prompts as NumPy int32 arrays (read in place, without a copy) in the later rows, and
all-miss prompts built just before each call ("fresh lists": hot in the CPU caches, as a
tokenizer hands them over) in the last.

    python benches/prefix_admission.py [--repeat 5] [--iters 2000]

Prints microseconds per admit + free (best of `--repeat` rounds; each round times every case
once, round-robin) and the ratios the targets are stated in (benches/README.md, Prefix
admission), each also as the median of its per-round ratios. Wall time on a shared machine:
read the ratios.

Which prompts a ratio is read on matters: the pre-built prompts cycle through 1,000 lists
whose int objects are cold in the CPU caches, so reading one costs the same with caching on or
off and narrows the all-miss ratio (benches/results/2026-12-02-prefix-admission.md, "Follow-up:
direct list reader"); fresh lists and int32 arrays show the
caching work against a cheaper read.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import numpy as np
import pagedkv

BS = 16
SYSTEM = 1024
SUFFIX = 300


def _w2_prompts(n: int) -> list[list[int]]:
    system = list(range(2_000_000_000, 2_000_000_000 + SYSTEM))
    return [system + [i * 512 + j for j in range(SUFFIX)] for i in range(n)]


def _miss_prompts(n: int) -> list[list[int]]:
    return [[1_000_000 + i * 4096 + j for j in range(SYSTEM + SUFFIX)] for i in range(n)]


def _pass(kv: pagedkv.KvCacheManager, prompts: Sequence[object], first_id: int) -> float:
    """One admit + free of every prompt; microseconds per prompt."""
    add, free = kv.add_sequence, kv.free
    start = time.perf_counter_ns()
    for i, p in enumerate(prompts):
        add(first_id + i, p)
        free(first_id + i)
    return (time.perf_counter_ns() - start) / len(prompts) / 1000


class FreshMissPrompts:
    """`n` all-miss prompts, each built as a new list just before its call (distinct from every
    earlier one, so each misses the cache); `_fresh_pass` times only the manager calls."""

    def __init__(self, n: int) -> None:
        self.n = n
        # Ids from 1e9 up: unused by the other cases, and below 2^32 for 2.4 M prompts.
        self.next_base = 1_000_000_000

    def __len__(self) -> int:
        return self.n


def _fresh_pass(kv: pagedkv.KvCacheManager, prompts: FreshMissPrompts, first_id: int) -> float:
    """One admit + free of `prompts.n` fresh all-miss prompts; microseconds per prompt."""
    add, free, clock = kv.add_sequence, kv.free, time.perf_counter_ns
    length = SYSTEM + SUFFIX
    total = 0
    for i in range(prompts.n):
        base = prompts.next_base
        prompts.next_base += length
        prompt = list(range(base, base + length))
        start = clock()
        add(first_id + i, prompt)
        free(first_id + i)
        total += clock() - start
    return total / prompts.n / 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--iters", type=int, default=2000)
    args = ap.parse_args()
    w2 = _w2_prompts(args.iters)
    miss = _miss_prompts(args.iters)
    w2_np = [np.asarray(p, dtype=np.int32) for p in w2]
    miss_np = [np.asarray(p, dtype=np.int32) for p in miss]

    def mk(caching: bool, events: bool = False) -> pagedkv.KvCacheManager:
        kv = pagedkv.KvCacheManager(
            num_blocks=65_536, block_size=BS, enable_prefix_caching=caching, enable_kv_events=events
        )
        kv.add_sequence(10**12, w2[0])  # warm: the system prompt is cached
        kv.free(10**12)
        return kv

    # The all-miss ratio compares the same prompts with caching on and off: the miss prompts'
    # int objects are all distinct (cold in the cache), the W2 prompts share the system
    # prompt's, so reading a miss prompt costs more whatever the cache does.
    cases = {
        "caching off": (mk(False), w2),
        "caching off, miss prompts": (mk(False), miss),
        "W2 hit, events off": (mk(True), w2),
        "W2 hit, events on": (mk(True, True), w2),
        "all miss, events off": (mk(True), miss),
        "all miss, events on": (mk(True, True), miss),
        "int32 array, caching off": (mk(False), w2_np),
        "int32, off, miss prompts": (mk(False), miss_np),
        "int32 array, W2 hit": (mk(True), w2_np),
        "int32 array, all miss": (mk(True), miss_np),
        "fresh lists, caching off": (mk(False), FreshMissPrompts(args.iters)),
        "fresh lists, all miss": (mk(True), FreshMissPrompts(args.iters)),
    }
    # Round-robin: each round times every case once, so the cases a ratio compares ran
    # seconds apart, not minutes (this machine's speed drifts by tens of percent); each case
    # reports its best round, and each ratio also the median of its per-round ratios.
    times: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(args.repeat):
        for name, (kv, prompts) in cases.items():
            # An untimed pass first: the others' passes evicted this case's index (~12 MiB)
            # from the CPU caches; sequential runs of one case find it warm, and so does this.
            run = _fresh_pass if isinstance(prompts, FreshMissPrompts) else _pass
            run(kv, prompts, 2 * r * len(prompts))  # type: ignore[arg-type]
            times[name].append(run(kv, prompts, (2 * r + 1) * len(prompts)))  # type: ignore[arg-type]
    rows = {name: min(ts) for name, ts in times.items()}

    def ratio(a: str, b: str) -> str:
        per_round = sorted(x / y for x, y in zip(times[a], times[b], strict=True))
        median = per_round[len(per_round) // 2]
        return f"{rows[a] / rows[b]:.2f}x (per-round median {median:.2f}x)"

    for name, us in rows.items():
        print(f"{name:26s} {us:8.2f} us per admit+free")
    off = "caching off, miss prompts"
    print(f"all-miss / caching-off (events off): {ratio('all miss, events off', off)}")
    print(f"all-miss events on / caching-off: {ratio('all miss, events on', off)}")
    print(
        f"int32 arrays: all-miss / caching-off: {ratio('int32 array, all miss', 'int32, off, miss prompts')}"
    )
    print(
        f"fresh lists: all-miss / caching-off: {ratio('fresh lists, all miss', 'fresh lists, caching off')}"
    )
    print(f"W2 hit / caching-off (same prompts): {ratio('W2 hit, events off', 'caching off')}")
    print(f"int32 arrays / lists (W2 hit): {ratio('int32 array, W2 hit', 'W2 hit, events off')}")
    print(f"events on / off (W2): {ratio('W2 hit, events on', 'W2 hit, events off')}")
    print(f"events on / off (all miss): {ratio('all miss, events on', 'all miss, events off')}")


if __name__ == "__main__":
    main()
