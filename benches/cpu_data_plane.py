"""The CPU data plane (``backend="cpu"``) against the NumPy reference and a plain copy, one run.

1. ``kernel``: paged decode attention at batch 32, 2 K context, 8 query / 2 KV heads of 64,
   block 16 (the issue's target shape), fp32 and fp16: bytes/s of the K/V it reads beside
   ``np.copyto`` of the same bytes; and the NumPy reference against the kernel at a smaller shape.
2. ``engine``: the SmolLM2 engine's aggregate decode throughput at batch 1 / 8 / 32 (16-token
   prompts, greedy, ignore_eos) on the NumPy data plane and on the CPU data plane, with
   OpenBLAS limited to 1 and to 2 threads (threadpoolctl; skipped with a note without it).

    python benches/cpu_data_plane.py [--sections kernel,engine] [--out results.json]

Ratios come from one run; the machine may be shared, so each engine row also reports tokens per
CPU-second (process time).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
from pagedkv.attention import paged_attention
from pagedkv.benchmarks.decode import best_of, drive_decode


def kernel_row(
    rng: np.random.Generator,
    dtype: type,
    tables: np.ndarray,
    lens: np.ndarray,
    cache_shape: tuple[int, int, int, int],
    nq: int,
    repeats: int,
) -> dict[str, float]:
    """Decode attention over caches of ``cache_shape`` beside a copy of the same K/V bytes."""
    k = rng.standard_normal(cache_shape).astype(dtype)
    v = rng.standard_normal(cache_shape).astype(dtype)
    q = rng.standard_normal((tables.shape[0], nq, cache_shape[3])).astype(dtype)
    kv_bytes = k.nbytes + v.nbytes
    dst_k, dst_v = np.empty_like(k), np.empty_like(v)

    def copy() -> None:
        np.copyto(dst_k, k)
        np.copyto(dst_v, v)

    attn_s = best_of(lambda: paged_attention(q, k, v, tables, lens, backend="cpu"), repeats)
    copy_s = best_of(copy, repeats)
    return {
        "kv_bytes": kv_bytes,
        "attention_ms": attn_s * 1e3,
        "attention_gb_per_s": kv_bytes / attn_s / 1e9,
        "copy_ms": copy_s * 1e3,
        "copy_gb_per_s": kv_bytes / copy_s / 1e9,
        "attention_over_copy": copy_s / attn_s,
    }


def kernel_section(repeats: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    batch, ctx, nq, nkv, hd, bs = 32, 2048, 8, 2, 64, 16
    blocks_per_seq = ctx // bs
    num_blocks = batch * blocks_per_seq
    out: dict[str, Any] = {
        "shape": {"batch": batch, "context": ctx, "q_heads": nq, "kv_heads": nkv, "head_dim": hd}
    }
    tables = rng.permutation(num_blocks).astype(np.int32).reshape(batch, blocks_per_seq)
    lens = np.full(batch, ctx, np.int32)
    for dtype in (np.float32, np.float16):
        out[np.dtype(dtype).name] = kernel_row(
            rng, dtype, tables, lens, (num_blocks, bs, nkv, hd), nq, repeats
        )
    # The reference is a Python loop over sequences and keys: a smaller shape.
    small_b, small_ctx = 8, 256
    k = rng.standard_normal((small_b * small_ctx // bs, bs, nkv, hd)).astype(np.float32)
    q = rng.standard_normal((small_b, nq, hd)).astype(np.float32)
    t = np.arange(small_b * small_ctx // bs, dtype=np.int32).reshape(small_b, -1)
    sl = np.full(small_b, small_ctx, np.int32)
    ref_s = best_of(lambda: paged_attention(q, k, k, t, sl), max(1, repeats // 3))
    cpu_s = best_of(lambda: paged_attention(q, k, k, t, sl, backend="cpu"), repeats)
    out["vs_reference"] = {
        "shape": {"batch": small_b, "context": small_ctx},
        "numpy_ms": ref_s * 1e3,
        "cpu_ms": cpu_s * 1e3,
        "speedup": ref_s / cpu_s,
    }
    return out


@contextlib.contextmanager
def blas_threads(n: int | None) -> Iterator[bool]:
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        yield False
        return
    with threadpool_limits(limits=n, user_api="blas"):
        yield True


def engine_section(batches: tuple[int, ...], out_len: int) -> dict[str, Any]:
    from pagedkv.models import load_model

    model = load_model()
    saved = os.environ.get("PAGEDKV_DATA_PLANE")
    result: dict[str, Any] = {"prompt_len": 16, "decode_tokens_per_request": out_len - 1}
    try:
        # numpy with 2 BLAS threads is the engine as it was (the reference data plane, OpenBLAS's
        # default thread count); cpu with 1 thread is the new default.
        for plane, threads in (("numpy", 2), ("cpu", 1), ("cpu", 2)):
            key = f"{plane}_blas{threads}"
            with blas_threads(threads) as limited:
                if not limited:
                    result[key] = "threadpoolctl is not installed: BLAS threads not set"
                    continue
                rows = {}
                for batch in batches:
                    print(f"engine: {key} batch {batch}", file=sys.stderr, flush=True)
                    os.environ["PAGEDKV_DATA_PLANE"] = plane
                    rows[str(batch)] = drive_decode(model, batch, 16, out_len - 1)
                result[key] = rows
    finally:
        if saved is None:
            os.environ.pop("PAGEDKV_DATA_PLANE", None)
        else:
            os.environ["PAGEDKV_DATA_PLANE"] = saved
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="kernel,engine")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out-tokens", type=int, default=17)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sections = args.sections.split(",")
    result: dict[str, Any] = {"cpus": os.cpu_count(), "load_average": os.getloadavg()}
    if "kernel" in sections:
        result["kernel"] = kernel_section(args.repeats)
        print(json.dumps(result["kernel"], indent=1), flush=True)
    if "engine" in sections:
        batches = tuple(int(b) for b in args.batches.split(","))
        result["engine"] = engine_section(batches, args.out_tokens)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
