"""The memcheck stage of `scripts/gpu_run.sh`: small decode and prefill launches for compute-sanitizer.

    compute-sanitizer --tool memcheck --error-exitcode 86 python benches/gpu_sanitize.py
    python benches/gpu_sanitize.py --backend numpy      # a dry run: the cases on the reference

Every case runs on small shapes (the sanitizer slows kernels by orders of magnitude) and is
compared with the NumPy reference, so the stage fails on a wrong result as well as on a memory
error. The cases cover each kernel the launchers pick: tensor-core decode with splits (and the
merge kernel), CUDA-core decode under a sliding window with released (-1) blocks, and paged
prefill over a mixed batch (a whole prompt, a prefix-hit suffix, a decode row) with split keys.
Unused cache slots hold NaN, so a stray read that memcheck cannot see (inside an allocation)
still shows in the output.

CuPy's memory pool hands out pieces of larger allocations, inside which memcheck sees no bounds;
the pool is switched off here, so every array is its own cudaMalloc and a read or write past any
array's end is an error the sanitizer reports.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np


def _cache(rng: np.random.Generator, kind: str, lens: list[int], heads: int, head_dim: int, block: int):
    """Caches with NaN in every slot no sequence uses, random non-contiguous tables, -1 padding."""
    from pagedkv.attention.dtypes import float32_to_bf16_bits, nan_fill_value

    pages = [math.ceil(n / block) for n in lens]
    num_blocks = sum(pages) + 2
    ids = rng.permutation(num_blocks)
    tables = np.full((len(lens), max(pages) + 1), -1, np.int32)
    used = np.zeros((num_blocks, block), bool)
    pos = 0
    for b, (n, k) in enumerate(zip(lens, pages, strict=True)):
        tables[b, :k] = ids[pos : pos + k]
        pos += k
        for t in range(n):
            used[tables[b, t // block], t % block] = True

    def make(shape: tuple[int, ...]) -> np.ndarray:
        x = rng.standard_normal(shape).astype(np.float32)
        return float32_to_bf16_bits(x) if kind == "bfloat16" else x.astype(np.float16)

    k_cache, v_cache = (make((num_blocks, block, heads, head_dim)) for _ in range(2))
    k_cache[~used] = nan_fill_value(kind)
    v_cache[~used] = nan_fill_value(kind)
    return make, k_cache, v_cache, tables, np.array(lens, np.int32)


def cases(backend: str, xp: Any) -> list[tuple[str, float, float]]:
    """(name, max |error|, tolerance) of each case against the NumPy reference."""
    from pagedkv.attention import paged_attention, paged_prefill_attention
    from pagedkv.attention.dtypes import to_compute

    rng = np.random.default_rng(86)
    results = []

    def compare(name: str, kind: str, out: Any, expected: np.ndarray) -> None:
        got = to_compute(out.get() if hasattr(out, "get") else out, kind)
        err = float(np.max(np.abs(got - to_compute(expected, kind))))
        err = math.inf if np.isnan(got).any() else err
        tol = 2e-3 if kind == "float16" else 1.6e-2
        print(f"  {name}: max|err|={err:.2e} (tol {tol}) {'ok' if err <= tol else 'FAIL'}", flush=True)
        results.append((name, err, tol))

    # Decode on tensor cores (fp16, group 4), three splits and the merge.
    make, k, v, tables, lens = _cache(rng, "float16", [1, 77, 300], 2, 128, 16)
    q = make((3, 8, 128))
    expected = paged_attention(q, k, v, tables, lens)
    dev = [xp.asarray(a) for a in (q, k, v)]
    compare(
        "decode fp16 d128 group 4 (tensor cores), 3 splits",
        "float16",
        paged_attention(*dev, tables, lens, backend=backend, num_splits=3),
        expected,
    )
    # Decode on CUDA cores (bf16, group 1) under a window of 40, blocks before it released.
    make, k, v, tables, lens = _cache(rng, "bfloat16", [5, 90, 200], 2, 64, 8)
    q = make((3, 2, 64))
    expected = paged_attention(q, k, v, tables, lens, window=40)
    for b, n in enumerate(lens):
        released = max(0, int(n) - 40) // 8
        tables[b, :released] = -1
    dev = [xp.asarray(a) for a in (q, k, v)]
    compare(
        "decode bf16 d64 group 1 (CUDA cores), window 40, 2 splits",
        "bfloat16",
        paged_attention(*dev, tables, lens, backend=backend, num_splits=2, window=40),
        expected,
    )
    # Prefill (fp16, group 4): a whole prompt, a prefix-hit suffix and a decode row, keys split.
    make, k, v, tables, lens = _cache(rng, "float16", [45, 137, 60], 2, 128, 16)
    qsl = np.array([0, 45, 45 + 37, 45 + 37 + 1], np.int32)
    q = make((int(qsl[-1]), 8, 128))
    expected = paged_prefill_attention(q, k, v, tables, lens, qsl)
    dev = [xp.asarray(a) for a in (q, k, v)]
    compare(
        "prefill fp16 d128 group 4, mixed batch, 2 splits",
        "float16",
        paged_prefill_attention(*dev, tables, lens, qsl, backend=backend, num_splits=2),
        expected,
    )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", default="cuda", choices=("cuda", "emulated", "numpy"))
    parser.add_argument("--out", help="write the cases' results as JSON here")
    args = parser.parse_args(argv)
    xp: Any = np
    if args.backend == "cuda":
        import cupy

        cupy.cuda.set_allocator(None)  # every array its own cudaMalloc: memcheck sees its bounds
        xp = cupy
    results = cases(args.backend, xp)
    failed = sum(err > tol for _, err, tol in results)
    if args.out:
        payload = {
            "backend": args.backend,
            "sanitizer": os.environ.get("PAGEDKV_SANITIZER_TOOL", "none"),
            "cases": [{"case": n, "max_abs_error": e, "tolerance": t} for n, e, t in results],
            "failed": failed,
        }
        Path(args.out).write_text(json.dumps(payload, indent=1, default=str))
    print(f"{len(results) - failed} of {len(results)} cases within tolerance on backend={args.backend}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
