"""The manager calls the engine makes per decode step since it moved to per-chunk allocation
(docs/embedding.md): per decoding sequence `num_tokens` (is its sampled token still missing?),
`allocate_slots(seq, 1)` and `provide_token_ids(seq, [token])`, against the one batched call it
made before (`append_tokens_batch` over every decoding sequence), in one run.

    python benches/engine_decode_calls.py [--seqs 32] [--steps 400] [--repeat 3]

Prints microseconds per decode step (best of `--repeat`) for both and their ratio. Read it beside
the engine's own decode step at the same batch (benches/results/, the decode rows): what matters
is the per-chunk calls' share of a step, not their ratio to the batched call.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import pagedkv

PROMPT_TOKENS = 300


def _manager(num_seqs: int) -> pagedkv.KvCacheManager:
    kv = pagedkv.KvCacheManager(8192, 16, True)
    for s in range(num_seqs):
        prompt = list(range(s * 1000, s * 1000 + PROMPT_TOKENS))
        kv.add_sequence(s, prompt, num_scheduled=PROMPT_TOKENS, reserve_prompt=False)
    return kv


def per_chunk_us(num_seqs: int, steps: int) -> float:
    kv = _manager(num_seqs)
    start = time.perf_counter()
    for step in range(steps):
        for s in range(num_seqs):
            kv.num_tokens(s)
            if not kv.allocate_slots(s, 1):
                raise RuntimeError("the pool is sized so that no allocation is refused")
            kv.provide_token_ids(s, np.array([step], dtype=np.int64))
    return (time.perf_counter() - start) / steps * 1e6


def batched_us(num_seqs: int, steps: int) -> float:
    kv = _manager(num_seqs)
    ids = np.arange(num_seqs, dtype=np.uint64)
    start = time.perf_counter()
    for step in range(steps):
        kv.append_tokens_batch(ids, np.full(num_seqs, step, dtype=np.int64))
    return (time.perf_counter() - start) / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    per_chunk = min(per_chunk_us(args.seqs, args.steps) for _ in range(args.repeat))
    batched = min(batched_us(args.seqs, args.steps) for _ in range(args.repeat))
    print(f"{args.seqs} decoding sequences, best of {args.repeat} x {args.steps} steps")
    print(f"per-chunk calls (num_tokens + allocate_slots + provide_token_ids): {per_chunk:.1f} us/step")
    print(f"one append_tokens_batch:                                        {batched:.1f} us/step")
    print(f"ratio per-chunk / batched: {per_chunk / batched:.1f}x")


if __name__ == "__main__":
    main()
