"""GPU paged-prefill benchmark: correctness first, then TFLOP/s over a sweep, in one run.

    python benches/gpu_prefill.py --out results/prefill.json
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
   % of the device's dense fp16/bf16 tensor-core peak (benches/gpu_specs.py: a table of datasheet
   figures by device name; a GPU it does not list is reported against a cuBLAS fp16 matrix
   product measured in the same run), and a baseline on the same
   shapes: FlashInfer's BatchPrefillWithPagedKVCacheWrapper on the very same caches and CSR
   tables where it imports, else PyTorch's scaled_dot_product_attention forced onto its flash
   backend (FlashAttention-2) on contiguous, unpaged copies of the same sizes (causal,
   bottom-right aligned: ``causal_lower_right`` where part of the prompt is cached), with the
   baseline's time over ours (> 1: ours is faster).

--out writes the JSON (and the printed table as text next to it, FILE.txt) after the
correctness step and after every sweep point, so a run cut short keeps every finished point;
--budget-s stops the sweep early (the device script gives it a fixed share of 8 minutes).

On a lent GPU machine without a Rust toolchain: `scripts/gpu_run.sh` (docs/decode_kernel.md §5).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gpu_specs import NOMINAL, GpuSpec, describe, lookup, measured
from gpu_timing import random_values, time_kernel

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


class SdpaFlashPrefill:
    """PyTorch's scaled_dot_product_attention on its flash backend only (no silent fallback to
    the math kernel), on contiguous [batch, heads, tokens, head_dim] tensors of the point's sizes.
    Unpaged, so it bounds what a contiguous-cache kernel reaches on the same causal work."""

    name = "SDPA-flash"

    def __init__(self) -> None:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
        self.torch, self.sdpa_kernel, self.backend = torch, sdpa_kernel, SDPBackend.FLASH_ATTENTION
        self.version = torch.__version__

    def prepare(self, point: SweepPoint) -> Any:
        torch = self.torch
        from torch.nn.attention.bias import causal_lower_right

        dtype = torch.float16 if point.kind == "float16" else torch.bfloat16
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(
            point.batch,
            point.num_q_heads,
            point.q_len,
            point.head_dim,
            device="cuda",
            dtype=dtype,
            generator=gen,
        )
        kv_shape = (point.batch, point.num_kv_heads, point.prompt, point.head_dim)
        k = torch.randn(kv_shape, device="cuda", dtype=dtype, generator=gen)
        v = torch.randn(kv_shape, device="cuda", dtype=dtype, generator=gen)
        # Queries are the prompt's last q_len tokens: the mask is bottom-right aligned.
        mask: Any = None if point.cached == 0 else causal_lower_right(point.q_len, point.prompt)
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def runner(k: Any, v: Any, gqa: bool) -> Any:
            def run() -> Any:
                with self.sdpa_kernel(self.backend):
                    if mask is None:
                        return sdpa(q, k, v, is_causal=True, enable_gqa=gqa)
                    return sdpa(q, k, v, attn_mask=mask, enable_gqa=gqa)

            return run

        self.expanded_kv = False
        run = runner(k, v, point.group > 1)
        try:
            run()  # refuses here (RuntimeError: no available kernel) where flash cannot run it
        except (RuntimeError, TypeError):
            if point.group == 1:
                raise
            # A flash backend without grouped-query support: K/V repeated per query head (more
            # bytes read, the same FLOPs; prefill is compute-bound). Raises if this fails too.
            self.expanded_kv = True
            run = runner(
                k.repeat_interleave(point.group, dim=1), v.repeat_interleave(point.group, dim=1), False
            )
            run()
        return run


def write_results(out: Path | None, payload: dict, lines: list[str]) -> None:
    """Rewrites the result files atomically: a run cut short keeps every finished point."""
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    for path, text in (
        (out, json.dumps(payload, indent=1)),
        (Path(str(out) + ".txt"), "\n".join(lines) + "\n"),
    ):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)


def gemm_flops(cupy: Any, n: int = 8192) -> float:
    """FLOP/s of an n x n x n fp16 matrix product through CuPy (cuBLAS): the measured peak of a
    GPU gpu_specs does not list."""
    a, b = (cupy.random.standard_normal((n, n), dtype=cupy.float32).astype(cupy.float16) for _ in range(2))
    return 2 * n**3 / time_kernel(cupy, lambda: cupy.matmul(a, b), min_iters=5)


def run_sweep(args: argparse.Namespace) -> int:
    import cupy
    from pagedkv.attention import prefill_launch
    from pagedkv.attention.prefill_validation import check_paged_prefill
    from pagedkv.attention.runners import get_runner

    started = time.perf_counter()
    runner = get_runner("cuda")
    out = Path(args.out) if args.out else None
    device = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(device.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    num_sms = int(device.attributes["MultiProcessorCount"])
    print(f"device: {name}, {num_sms} SMs, CuPy {cupy.__version__}")
    spec: GpuSpec = lookup(name) or measured(name, num_sms, None, gemm_flops(cupy))
    cupy.get_default_memory_pool().free_all_blocks()
    peak_flops = spec.peak_flops or 1.0
    print(f"   peak: {describe(spec)}")
    meta: dict[str, Any] = {
        "device": name,
        "gpu": asdict(spec),
        "python": platform.python_version(),
        "cupy": cupy.__version__,
    }
    payload: dict[str, Any] = {"meta": meta, "rows": [], "complete": False}
    lines: list[str] = []
    print("1. correctness (cuda backend vs NumPy reference)")
    failures = correctness("cuda", cupy)
    payload["correctness_failures"] = failures
    write_results(out, payload, lines)
    if failures:
        print("correctness FAILED:", failures)
        return 1
    baseline: Any = None
    try:
        baseline = FlashInferPrefill()
        meta["baseline"] = f"FlashInfer {baseline.flashinfer.__version__}"
    except Exception as exc:  # not installed, or no torch
        print(f"   FlashInfer not available ({type(exc).__name__}: {exc})")
        try:
            baseline = SdpaFlashPrefill()
            meta["baseline"] = f"PyTorch {baseline.version} SDPA, flash backend (contiguous K/V)"
        except Exception as exc2:  # no torch, or torch without CUDA
            print(f"   PyTorch SDPA not available ({type(exc2).__name__}: {exc2}); our kernel only")
    print(f"   baseline: {meta.get('baseline', 'none')}")
    print("2. sweep")
    header = (
        f"{'kind':<8} {'prompt':>6} {'batch':>5} {'cached':>6} {'group':>5} {'ms':>9} {'TFLOP/s':>8} "
        f"{'%peak':>6} {'base ms':>9} {'base/us':>7}"
    )
    print(header)
    lines.append(header)
    rows = payload["rows"]
    rng = np.random.default_rng(0)
    points = sweep()
    if args.quick:
        points = [p for p in points if p.prompt <= 2048]
    for point in points:
        if time.perf_counter() - started > args.budget_s:
            print(f"budget of {args.budget_s:.0f} s spent: {len(rows)} of {len(points)} points measured")
            break
        q, k, v, tables, lens, qsl = make_inputs(
            cupy, point, rng, lambda s, kind=point.kind: random_values(cupy, s, kind)
        )
        csr = to_csr(tables, lens, point.block_size)
        # Validate and plan once (host work, as FlashInfer's plan()), then time the launches.
        checked = check_paged_prefill(q, k, v, csr, lens, qsl, None, True, "cuda")
        launch_plan = prefill_launch.plan(runner, checked, None)
        t = time_kernel(cupy, lambda lp=launch_plan, c=checked: prefill_launch.launch(runner, lp, c))
        row: dict[str, Any] = {**asdict(point), "seconds": t, "tflops": point.flops / t / 1e12}
        row["pct_peak"] = 100 * point.flops / t / peak_flops
        base_text = f"{'-':>9} {'-':>7}"
        if baseline is not None:
            try:
                if isinstance(baseline, FlashInferPrefill):
                    fn = baseline.prepare(point, q, k, v, csr, qsl)
                else:
                    fn = baseline.prepare(point)
                base = time_kernel(cupy, fn)
                if getattr(baseline, "expanded_kv", False):
                    row["baseline_expanded_kv"] = True
                row["baseline_seconds"] = base
                row["baseline_over_ours"] = base / t
                base_text = f"{base * 1e3:>9.3f} {base / t:>7.2f}"
            except Exception as exc:
                row["baseline_error"] = f"{type(exc).__name__}: {exc}"[:300]
        line = (
            f"{point.kind:<8} {point.prompt:>6} {point.batch:>5} {point.cached:>6} {point.group:>5} "
            f"{t * 1e3:>9.3f} {row['tflops']:>8.1f} {row['pct_peak']:>6.1f} {base_text}"
        )
        print(line, flush=True)
        lines.append(line)
        rows.append(row)
        payload["elapsed_s"] = time.perf_counter() - started
        write_results(out, payload, lines)
        del q, k, v
        cupy.get_default_memory_pool().free_all_blocks()
    else:
        payload["complete"] = True
    payload["elapsed_s"] = time.perf_counter() - started
    write_results(out, payload, lines)
    if out is not None:
        print(f"wrote {out} and {out}.txt")
    return 0


def dry_run(args: argparse.Namespace) -> int:
    points = sweep()
    check_accounting(points)
    print(f"{len(points)} sweep points; FLOP accounting checked")
    # The result files the device run writes, with the points it would measure (checks --out).
    out = Path(args.out) if args.out else None
    meta = {"dry_run": True, "gpu": asdict(NOMINAL)}
    print(f"peaks of the expected GPU: {describe(NOMINAL)}")
    payload = {"meta": meta, "rows": [asdict(p) for p in points], "complete": True}
    write_results(out, payload, [f"{len(points)} sweep points (dry run)"])
    failures = correctness(args.backend, np) if args.backend != "none" else []
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
        choices=("numpy", "emulated", "none"),
        help="--dry-run's correctness backend (emulated runs the real kernel on the CPU: slow)",
    )
    parser.add_argument("--quick", action="store_true", help="only prompts <= 2K")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=300.0,
        help="stop the sweep after this many seconds (results so far are kept)",
    )
    args = parser.parse_args(argv)
    return dry_run(args) if args.dry_run else run_sweep(args)


if __name__ == "__main__":
    sys.exit(main())
