"""A driver for profiling one quantize-on-write case on ``backend="cpu"`` (callgrind): the
write ``benches/quant_write_cost.py`` times, ``--batch`` tokens (one per sequence, each into its
own block) in float16, ``reps`` calls.

    valgrind --tool=callgrind --toggle-collect='*write_kv*' \\
        python benches/quant_write_profile.py int8 3 64 park 2

``park`` writes offset 3 (int4: the token parks in its int8 residual), ``seal`` offset 15 (int4:
the write seals the block). Instructions per token: the collected count / (reps * batch)
(benches/results/2026-12-06-quant-write-cost-v2.md).
"""

from __future__ import annotations

import argparse

import numpy as np
from pagedkv.attention import QuantizedKvCache, write_kv

BLOCK_SIZE = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dtype", choices=["float16", "int8", "fp8_e4m3", "int4"])
    parser.add_argument("heads", type=int)
    parser.add_argument("dim", type=int)
    parser.add_argument("mode", choices=["park", "seal"])
    parser.add_argument("reps", type=int)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    batch, shape = args.batch, (args.batch, BLOCK_SIZE, args.heads, args.dim)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((batch, args.heads, args.dim)).astype(np.float16)
    v = rng.standard_normal((batch, args.heads, args.dim)).astype(np.float16)
    offset = 3 if args.mode == "park" else BLOCK_SIZE - 1
    slots = (np.arange(batch) * BLOCK_SIZE + offset).astype(np.int64)
    res = np.arange(batch, dtype=np.int32) if args.dtype == "int4" else None
    if args.dtype == "float16":
        kc: object = np.zeros(shape, np.float16)
        vc: object = np.zeros(shape, np.float16)
    else:
        n = batch if args.dtype == "int4" else 0
        kc = QuantizedKvCache.empty(args.dtype, "key", *shape, num_residual_slots=n)
        vc = QuantizedKvCache.empty(args.dtype, "value", *shape, num_residual_slots=n)
    for _ in range(args.reps):
        write_kv(k, v, kc, vc, slots, backend="cpu", residual_slots=res)


if __name__ == "__main__":
    main()
