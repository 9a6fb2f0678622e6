"""What quantize-on-write costs per token on ``backend="cpu"``, as a ratio to the float16 cache's
write in the same run.

A decode-like write (one token per sequence, ``--batch`` sequences, each token into its own
block) at the engine's two models' K/V shapes, keys and values in float16: the float16 cache
(a copy), ``int8`` (a UE5M3 scale and codes per (token, head)), ``int4`` parking the token in its
int8 residual slot (offset 3: the block stays open) and ``int4`` sealing (offset 15: the write
fills the block, whose 16 tokens are quantized to int4, K and V). Thread CPU time per token,
best of ``--rounds`` interleaved rounds of ``--reps`` calls each, so the ratios come from one run
on one load (docs/quantized_kv.md). A seal's time is a whole block's work, paid once per
``block_size`` tokens.

    python benches/quant_write_cost.py --out benches/results/2026-12-06-quant-write-cost.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from pagedkv.attention import QuantizedKvCache, write_kv

SHAPES = {"SmolLM2-135M (3 KV heads x 64)": (3, 64), "Gemma 3 270M (1 KV head x 256)": (1, 256)}
BLOCK_SIZE = 16


def _cases(batch: int, heads: int, dim: int) -> dict[str, tuple[Any, Any, np.ndarray, Any]]:
    open_slots = (np.arange(batch) * BLOCK_SIZE + 3).astype(np.int64)
    sealing = (np.arange(batch) * BLOCK_SIZE + BLOCK_SIZE - 1).astype(np.int64)
    res = np.arange(batch, dtype=np.int32)
    shape = (batch, BLOCK_SIZE, heads, dim)

    def quant(dtype: str, role: str) -> QuantizedKvCache:
        slots = batch if dtype == "int4" else 0
        return QuantizedKvCache.empty(dtype, role, batch, BLOCK_SIZE, heads, dim, num_residual_slots=slots)

    return {
        "float16": (np.zeros(shape, np.float16), np.zeros(shape, np.float16), open_slots, None),
        "int8": (quant("int8", "key"), quant("int8", "value"), open_slots, None),
        "int4 park (int8 residual)": (quant("int4", "key"), quant("int4", "value"), open_slots, res),
        "int4 seal (16th token)": (quant("int4", "key"), quant("int4", "value"), sealing, res),
    }


def measure(heads: int, dim: int, batch: int, reps: int, rounds: int) -> dict[str, dict[str, float]]:
    rng = np.random.default_rng(0)
    k = rng.standard_normal((batch, heads, dim)).astype(np.float16)
    v = rng.standard_normal((batch, heads, dim)).astype(np.float16)
    cases = _cases(batch, heads, dim)
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(rounds):
        for name, (kc, vc, slots, res) in cases.items():
            start = time.thread_time()
            for _ in range(reps):
                write_kv(k, v, kc, vc, slots, backend="cpu", residual_slots=res)
            best[name] = min(best[name], (time.thread_time() - start) / (reps * batch))
    base = best["float16"]
    return {
        name: {"ns_per_token": round(t * 1e9, 1), "vs_float16": round(t / base, 2)}
        for name, t in best.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    result = {
        "batch": args.batch,
        "block_size": BLOCK_SIZE,
        "shapes": {name: measure(*hd, args.batch, args.reps, args.rounds) for name, hd in SHAPES.items()},
    }
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
