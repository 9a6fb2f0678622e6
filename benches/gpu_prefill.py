"""GPU paged-prefill benchmark: correctness first, then TFLOP/s over a sweep, in one run.

    python benches/gpu_prefill.py --out benches/results/h200_prefill.json
    python benches/gpu_prefill.py --dry-run --backend numpy   # no GPU: accounting + harness

Steps (each printed as it runs):
1. Correctness: the cuda backend against the NumPy reference on small mixed batches (whole
   prompts, prefix-hit suffixes, decode rows), fp16/bf16, group 1/8, padded and CSR tables.
   A mismatch stops the run (exit 1).
2. Sweep: prompt length {512, 2K, 8K} x batch {1, 8} x cached fraction {0, 50 %} x group {1, 8}
   x {fp16, bf16}, head_dim 128, block_size 16, 8 KV heads, random non-contiguous block tables.
   A prompt of length L with cached fraction f has L * f tokens already in the cache and
   L * (1 - f) new query tokens. For each point: median kernel time (CUDA events), TFLOP/s over
   the causal FLOPs (4 * head_dim per visible (query, key) pair per query head: QK^T and PV),
   % of the H200's dense fp16/bf16 tensor-core peak (989 TFLOP/s), and, where FlashInfer
   imports, its BatchPrefillWithPagedKVCacheWrapper on the very same caches and CSR tables,
   with our time as a ratio of FlashInfer's.

--out writes every number as JSON (plus the printed table as text next to it, FILE.txt).

On a lent GPU machine without a Rust toolchain: build the extension here (`maturin develop
--release`), carry `python/pagedkv/_core.abi3.so`, and run:

    PYTHONPATH=python python3 benches/gpu_prefill.py --out $OUT/h200_prefill.json && \
    PYTHONPATH=python python3 -m pytest -q -m gpu tests/kernels/test_gpu_prefill.py
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gpu_timing import random_values, time_kernel

PEAK_FLOPS = 989e12  # H200 SXM dense fp16/bf16 tensor-core peak
PROMPTS = (512, 2048, 8192)
BATCHES = (1, 8)
CACHED_FRACTIONS = (0.0, 0.5)
GROUPS = (1, 8)
KINDS = ("float16", "bfloat16")
HEAD_DIM = 128
BLOCK_SIZE = 16
NUM_KV_HEADS = 8


@dataclass
class SweepPoint:
    kind: str
    prompt: int
    batch: int
    cached_fraction: float
    group: int
    num_kv_heads: int = NUM_KV_HEADS
    head_dim: int = HEAD_DIM
    block_size: int = BLOCK_SIZE

    @property
    def num_q_heads(self) -> int:
        return self.num_kv_heads * self.group

    @property
    def cached(self) -> int:
        return int(self.prompt * self.cached_fraction)

    @property
    def q_len(self) -> int:
        return self.prompt - self.cached

    @property
    def visible_pairs(self) -> int:
        """(query, key) pairs one sequence computes: the query at position p sees p + 1 keys."""
        c, n = self.cached, self.q_len
        return n * (c + 1) + n * (n - 1) // 2

    @property
    def flops(self) -> int:
        return 4 * self.head_dim * self.num_q_heads * self.batch * self.visible_pairs


def sweep() -> list[SweepPoint]:
    return [
        SweepPoint(kind, prompt, batch, frac, group)
        for kind, prompt, batch, frac, group in itertools.product(
            KINDS, PROMPTS, BATCHES, CACHED_FRACTIONS, GROUPS
        )
    ]


def check_accounting(points: list[SweepPoint]) -> None:
    """The closed-form pair count equals a direct sum, and the sweep covers the issue's grid."""
    for p in points[:8]:
        direct = sum(pos + 1 for pos in range(p.cached, p.prompt))
        assert p.visible_pairs == direct, (p, direct)
    assert len(points) == len(KINDS) * len(PROMPTS) * len(BATCHES) * len(CACHED_FRACTIONS) * len(GROUPS)


def make_inputs(
    xp: Any, point: SweepPoint, rng: np.random.Generator, make: Any
) -> tuple[Any, Any, Any, np.ndarray, np.ndarray, np.ndarray]:
    """q, caches (random values, random non-contiguous block ids), padded tables, lens, qo_indptr."""
    blocks_per_seq = math.ceil(point.prompt / point.block_size)
    num_blocks = blocks_per_seq * point.batch + 1
    ids = rng.permutation(num_blocks)[: blocks_per_seq * point.batch].astype(np.int32)
    tables = ids.reshape(point.batch, blocks_per_seq)
    lens = np.full(point.batch, point.prompt, np.int32)
    qsl = (np.arange(point.batch + 1) * point.q_len).astype(np.int32)
    q = make((point.batch * point.q_len, point.num_q_heads, point.head_dim))
    k_cache = make((num_blocks, point.block_size, point.num_kv_heads, point.head_dim))
    v_cache = make((num_blocks, point.block_size, point.num_kv_heads, point.head_dim))
    return q, k_cache, v_cache, tables, lens, qsl


def to_csr(
    tables: np.ndarray, lens: np.ndarray, block_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    pages = (lens.astype(np.int64) + block_size - 1) // block_size
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    indices = np.concatenate([tables[b, : pages[b]] for b in range(len(lens))]).astype(np.int32)
    last = np.where(lens == 0, 0, (lens - 1) % block_size + 1).astype(np.int32)
    return indptr, indices, last


def correctness(backend: str, xp: Any) -> list[str]:
    """Small mixed batches through `backend` against the NumPy reference; returns failures."""
    from pagedkv.attention import paged_prefill_attention
    from pagedkv.attention.dtypes import float32_to_bf16_bits, nan_fill_value, to_compute

    failures = []
    rng = np.random.default_rng(1)
    cached, new = [0, 37, 100, 250], [45, 20, 1, 1]
    lens = np.array([c + n for c, n in zip(cached, new, strict=True)], np.int32)
    qsl = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    for kind, group, layout in itertools.product(KINDS, GROUPS, ("padded", "csr")):
        heads = 2
        pages = [math.ceil(int(n) / BLOCK_SIZE) for n in lens]
        num_blocks = sum(pages) + 3
        ids = rng.permutation(num_blocks)
        tables = np.full((len(lens), max(pages) + 1), -1, np.int32)
        pos = 0
        for b, k in enumerate(pages):
            tables[b, :k] = ids[pos : pos + k]
            pos += k

        def make(shape: tuple[int, ...], kind: str = kind) -> np.ndarray:
            x = rng.standard_normal(shape).astype(np.float32)
            return float32_to_bf16_bits(x) if kind == "bfloat16" else x.astype(np.float16)

        q = make((int(qsl[-1]), heads * group, HEAD_DIM))
        k_cache = make((num_blocks, BLOCK_SIZE, heads, HEAD_DIM))
        v_cache = make((num_blocks, BLOCK_SIZE, heads, HEAD_DIM))
        # Slots no sequence uses hold NaN: a stray read poisons the output.
        used = np.zeros((num_blocks, BLOCK_SIZE), bool)
        for b, n in enumerate(lens):
            for t in range(int(n)):
                used[tables[b, t // BLOCK_SIZE], t % BLOCK_SIZE] = True
        k_cache[~used] = nan_fill_value(kind)
        v_cache[~used] = nan_fill_value(kind)
        table_arg: Any = tables if layout == "padded" else to_csr(tables, lens, BLOCK_SIZE)
        expected = to_compute(paged_prefill_attention(q, k_cache, v_cache, table_arg, lens, qsl), kind)
        dev = [xp.asarray(a) for a in (q, k_cache, v_cache)]
        out = paged_prefill_attention(*dev, table_arg, lens, qsl, backend=backend)
        out = to_compute(out.get() if hasattr(out, "get") else out, kind)
        tol = 2e-3 if kind == "float16" else 1.6e-2
        err = float(np.max(np.abs(out - expected)))
        status = "ok" if err <= tol and not np.isnan(out).any() else "FAIL"
        print(f"  correctness {kind:<8} group={group} {layout:<6}: max|err|={err:.2e} (tol {tol}) {status}")
        if status != "ok":
            failures.append(f"{kind} group={group} {layout}: {err}")
    return failures


class FlashInferPrefill:
    """FlashInfer's paged prefill on the same caches (NHD layout == ours), if it imports."""

    def __init__(self) -> None:
        import flashinfer
        import torch

        self.flashinfer, self.torch = flashinfer, torch
        self.workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def prepare(self, point: SweepPoint, q: Any, k: Any, v: Any, csr: tuple, qsl: np.ndarray) -> Any:
        torch = self.torch
        dtype = torch.float16 if point.kind == "float16" else torch.bfloat16

        def tt(x: Any) -> Any:
            t = torch.from_dlpack(x)
            return t.view(dtype) if point.kind == "bfloat16" else t

        wrapper = self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        indptr, indices, last = (torch.from_numpy(a).cuda() for a in csr)
        wrapper.plan(
            torch.from_numpy(qsl).cuda(),
            indptr,
            indices,
            last,
            point.num_q_heads,
            point.num_kv_heads,
            point.head_dim,
            point.block_size,
            causal=True,
            q_data_type=dtype,
            kv_data_type=dtype,
        )
        tq, tk, tv = tt(q), tt(k), tt(v)
        return lambda: wrapper.run(tq, (tk, tv))


def run_sweep(args: argparse.Namespace) -> int:
    import cupy
    from pagedkv.attention import prefill_launch
    from pagedkv.attention.prefill_validation import check_paged_prefill
    from pagedkv.attention.runners import get_runner

    runner = get_runner("cuda")

    device = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(device.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    print(f"device: {name}, {device.attributes['MultiProcessorCount']} SMs, CuPy {cupy.__version__}")
    print("1. correctness (cuda backend vs NumPy reference)")
    failures = correctness("cuda", cupy)
    if failures:
        print("correctness FAILED:", failures)
        return 1
    flash = None
    try:
        flash = FlashInferPrefill()
        print(f"   FlashInfer {flash.flashinfer.__version__} side by side")
    except Exception as exc:  # not installed, or no torch
        print(f"   FlashInfer not available ({type(exc).__name__}: {exc}); our kernel only")
    print("2. sweep")
    header = (
        f"{'kind':<8} {'prompt':>6} {'batch':>5} {'cached':>6} {'group':>5} {'ms':>9} {'TFLOP/s':>8} "
        f"{'%peak':>6} {'FI ms':>9} {'FI/ours':>7}"
    )
    print(header)
    lines = [header]
    rows = []
    rng = np.random.default_rng(0)
    points = sweep()
    if args.quick:
        points = [p for p in points if p.prompt <= 2048]
    for point in points:
        q, k, v, tables, lens, qsl = make_inputs(
            cupy, point, rng, lambda s, kind=point.kind: random_values(cupy, s, kind)
        )
        csr = to_csr(tables, lens, point.block_size)
        # Validate and plan once (host work, as FlashInfer's plan()), then time the launches.
        checked = check_paged_prefill(q, k, v, csr, lens, qsl, None, True, "cuda")
        launch_plan = prefill_launch.plan(runner, checked, None)
        t = time_kernel(cupy, lambda lp=launch_plan, c=checked: prefill_launch.launch(runner, lp, c))
        row: dict[str, Any] = {**asdict(point), "seconds": t, "tflops": point.flops / t / 1e12}
        row["pct_peak"] = 100 * point.flops / t / PEAK_FLOPS
        fi_text = f"{'-':>9} {'-':>7}"
        if flash is not None:
            try:
                fi = time_kernel(cupy, flash.prepare(point, q, k, v, csr, qsl))
                row["flashinfer_seconds"] = fi
                row["ours_vs_flashinfer_speed"] = fi / t
                fi_text = f"{fi * 1e3:>9.3f} {fi / t:>7.2f}"
            except Exception as exc:
                row["flashinfer_error"] = f"{type(exc).__name__}: {exc}"
        line = (
            f"{point.kind:<8} {point.prompt:>6} {point.batch:>5} {point.cached:>6} {point.group:>5} "
            f"{t * 1e3:>9.3f} {row['tflops']:>8.1f} {row['pct_peak']:>6.1f} {fi_text}"
        )
        print(line)
        lines.append(line)
        rows.append(row)
        del q, k, v
        cupy.get_default_memory_pool().free_all_blocks()
    if args.out:
        out = Path(args.out)
        meta = {"device": name, "python": platform.python_version(), "cupy": cupy.__version__}
        out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        out.with_suffix(out.suffix + ".txt").write_text("\n".join(lines) + "\n")
    return 0


def dry_run(args: argparse.Namespace) -> int:
    points = sweep()
    check_accounting(points)
    print(f"{len(points)} sweep points; FLOP accounting checked")
    failures = correctness(args.backend, np)
    if failures:
        print("correctness FAILED:", failures)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", help="write results as JSON to this file (and the table to FILE.txt)")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: check the sweep and accounting only")
    parser.add_argument(
        "--backend",
        default="emulated",
        choices=("numpy", "emulated"),
        help="--dry-run's correctness backend (emulated runs the real kernel on the CPU: slow)",
    )
    parser.add_argument("--quick", action="store_true", help="only prompts <= 2K")
    args = parser.parse_args(argv)
    return dry_run(args) if args.dry_run else run_sweep(args)


if __name__ == "__main__":
    sys.exit(main())
