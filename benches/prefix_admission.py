"""Prefix admission through Python, as a new user calls it: W2-style prompts (a 1,024-token
cached system prompt + a 300-token unique suffix = 1,324 tokens, block size 16) admitted and
freed, against the same call with prefix caching off, and an all-miss prompt, in one run;
the same prompts as NumPy int32 arrays (read in place, without a copy) in the last rows.

    python benches/prefix_admission.py [--repeat 5] [--iters 2000]

Prints microseconds per admit + free (best of `--repeat`) and the ratios the targets are stated
in (benches/README.md, Prefix admission). Wall time on a shared machine: read the ratios.
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


def _time(kv: pagedkv.KvCacheManager, prompts: Sequence[object], repeat: int) -> float:
    add, free = kv.add_sequence, kv.free
    best = float("inf")
    for r in range(repeat):
        base = r * len(prompts)
        start = time.perf_counter_ns()
        for i, p in enumerate(prompts):
            add(base + i, p)
            free(base + i)
        best = min(best, (time.perf_counter_ns() - start) / len(prompts) / 1000)
    return best


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
    rows = {
        "caching off": _time(mk(False), w2, args.repeat),
        "caching off, miss prompts": _time(mk(False), miss, args.repeat),
        "W2 hit, events off": _time(mk(True), w2, args.repeat),
        "W2 hit, events on": _time(mk(True, True), w2, args.repeat),
        "all miss, events off": _time(mk(True), miss, args.repeat),
        "all miss, events on": _time(mk(True, True), miss, args.repeat),
        "int32 array, caching off": _time(mk(False), w2_np, args.repeat),
        "int32, off, miss prompts": _time(mk(False), miss_np, args.repeat),
        "int32 array, W2 hit": _time(mk(True), w2_np, args.repeat),
        "int32 array, all miss": _time(mk(True), miss_np, args.repeat),
    }
    for name, us in rows.items():
        print(f"{name:26s} {us:8.2f} us per admit+free")
    off = rows["caching off, miss prompts"]
    print(f"all-miss / caching-off (events off): {rows['all miss, events off'] / off:.2f}x")
    print(f"all-miss events on / caching-off: {rows['all miss, events on'] / off:.2f}x")
    np_off = rows["int32, off, miss prompts"]
    print(f"int32 arrays: all-miss / caching-off: {rows['int32 array, all miss'] / np_off:.2f}x")
    print(f"W2 hit / caching-off (same prompts): {rows['W2 hit, events off'] / rows['caching off']:.2f}x")
    print(f"int32 arrays / lists (W2 hit): {rows['int32 array, W2 hit'] / rows['W2 hit, events off']:.2f}x")
    print(f"events on / off (W2): {rows['W2 hit, events on'] / rows['W2 hit, events off']:.2f}x")
    print(f"events on / off (all miss): {rows['all miss, events on'] / rows['all miss, events off']:.2f}x")


if __name__ == "__main__":
    main()
