"""GPU decode-attention benchmark: correctness, copy bandwidth, and a bandwidth sweep, in one run.

    python benches/gpu_decode.py --out results/decode.json
    python benches/gpu_decode.py --kernel-only --out results/decode.json   # kernel times only
    python benches/gpu_decode.py --dry-run          # no GPU: checks the sweep, accounting, plans

Steps (each printed as it runs):
1. Correctness: the cuda backend against the NumPy reference on small paged problems
   (fp16/bf16, group 1/4/8, forced and automatic splits; groups 4 and 8 on both decode kernels,
   tensor cores and CUDA cores), and one sliding-window step through DecodeWorkspace(window=)
   with the blocks before each window released (-1, NaN); then the dense baseline (below) on a
   small problem. A mismatch stops the run (exit 1).
2. Device-to-device copy bandwidth (cudaMemcpy of a large buffer): the practical ceiling. The
   device's peak comes from benches/gpu_specs.py (a table of datasheet figures by device name);
   a GPU the table does not list is reported against this measured copy instead.
3. Sweep: batch {1, 8, 64} x context {1K, 4K, 16K} x group {1, 4, 8} x {fp16, bf16}, head_dim 128,
   block_size 16, 8 KV heads, random non-contiguous block tables. For each point:
   - kernel time: back-to-back DecodeWorkspace.run launches on preallocated buffers (no host
     work in the timed region), CUDA events around each launch, L2 flushed before every
     iteration (a write over twice the L2 size), median; achieved GB/s over the bytes a launch
     must read (K and V of every token, plus q and the output), % of the measured copy bandwidth
     and % of the device's peak (column `%peak`);
   - the planned splits, the CTAs per SM the occupancy API reports and the grid's waves;
   - where the launcher picks the tensor-core kernel (fp16/bf16, group >= 3), the CUDA-core kernel
     on the same buffers and plan too (DecodeWorkspace(use_tensor_cores=False)): its time
     (column `CC us`) and the ratio of kernel times tensor cores / CUDA cores (`TC/CC`, < 1 when
     the tensor-core path is faster), both from the same run;
   - the dense baseline (gpu_dense_decode.py): the same shapes over a contiguous, unpaged cache
     through PyTorch's scaled_dot_product_attention (else a matmul form in PyTorch or CuPy), timed
     the same way: its time (`dense us`) and dense time / ours (`dn/us`, > 1: ours is faster);
   - unless --kernel-only: the full paged_attention call (host validation, upload, allocation,
     launches) as wall time per synchronized call, reported as overhead over the kernel time;
     where FlashInfer imports, its BatchDecodeWithPagedKVCacheWrapper on the very same caches.
4. A num_splits sweep at a few points (SPLIT_SWEEP), to check the split planner's choice.

Everything is seeded (NumPy and CuPy generators). --out writes JSON after every point (and the
table as text next to it, FILE.txt), so a run cut short still leaves its results; --budget-s stops
the sweep early (default 420 s, so the whole device script stays under 8 minutes). --dry-run prints
an upper estimate of the device time (estimated_seconds: each timing's iterations at a pessimistic
50 % of the expected GPU's peak bandwidth, setup, compiles) next to the budget, checks the dense
baseline's matmul form on the CPU, and writes --out with every point's plan.

On a lent GPU machine without a Rust toolchain: `scripts/gpu_run.sh` (docs/decode_kernel.md §5:
build the extension on a CPU machine, carry `python/pagedkv/_core.abi3.so`).

The sweep's points, byte accounting, plans and device-time estimate are in gpu_decode_sweep.py,
the correctness step in gpu_decode_correctness.py; this script times and reports.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from gpu_decode_correctness import correctness, dense_correctness, windowed_workspace_correctness
from gpu_decode_sweep import (
    EST_COMPILE_S,
    EST_MIN_TIMING_S,
    SPLIT_COUNTS,
    SPLIT_SWEEP,
    Result,
    SweepPoint,
    block_tables,
    check_accounting,
    estimated_seconds,
    has_cuda_core_baseline,
    kernel_path,
    planned,
    sweep,
    target_pct,
)
from gpu_dense_decode import DenseDecode
from gpu_specs import NOMINAL, GpuSpec, describe, lookup, measured
from gpu_timing import random_values, time_kernel

# Read by tests/kernels/test_bench_script.py through this script.
__all__ = [
    "EST_COMPILE_S",
    "EST_MIN_TIMING_S",
    "SweepPoint",
    "estimated_seconds",
    "has_cuda_core_baseline",
    "main",
    "windowed_workspace_correctness",
]


def time_call(cupy: Any, fn: Callable[[], Any], flush: Callable[[], None] | None, iters: int = 20) -> float:
    """Median wall seconds of fn() followed by a stream sync: host work included."""
    stream = cupy.cuda.get_current_stream()
    for _ in range(3):
        fn()
    stream.synchronize()
    times = []
    for _ in range(iters):
        if flush is not None:
            flush()
            stream.synchronize()
        t0 = time.perf_counter()
        fn()
        stream.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class L2Flush:
    """Overwrites twice the device's L2 so the next launch reads its KV from HBM."""

    def __init__(self, cupy: Any) -> None:
        l2 = int(cupy.cuda.Device().attributes.get("L2CacheSize", 64 << 20))
        self.buffer = cupy.empty(max(2 * l2, 16 << 20), dtype=cupy.uint8)
        self.bytes = int(self.buffer.nbytes)

    def __call__(self) -> None:
        self.buffer.fill(1)


def copy_bandwidth(cupy: Any, num_bytes: int = 4 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting the read and the write."""
    buffers = [cupy.empty(num_bytes, dtype=cupy.uint8) for _ in range(2)]
    src_ptr, dst_ptr = buffers[0].data.ptr, buffers[1].data.ptr
    t = time_kernel(
        cupy,
        lambda: cupy.cuda.runtime.memcpyAsync(
            dst_ptr,
            src_ptr,
            num_bytes,
            cupy.cuda.runtime.memcpyDeviceToDevice,
            cupy.cuda.get_current_stream().ptr,
        ),
    )
    buffers.clear()  # free the 2 x 4 GiB before the sweep
    cupy.get_default_memory_pool().free_all_blocks()
    return 2 * num_bytes / t


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


class FlashInferDecode:
    """FlashInfer's paged decode on the same caches (NHD layout == ours), if it imports."""

    def __init__(self) -> None:
        import flashinfer
        import torch

        self.flashinfer, self.torch = flashinfer, torch
        self.workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def prepare(
        self,
        cupy: Any,
        point: SweepPoint,
        q: Any,
        k_cache: Any,
        v_cache: Any,
        tables: np.ndarray,
        lens: np.ndarray,
    ) -> Any:
        torch = self.torch
        dtype = torch.float16 if point.kind == "float16" else torch.bfloat16

        def tt(x: Any) -> Any:
            t = torch.from_dlpack(x)
            return t.view(dtype) if point.kind == "bfloat16" else t

        indptr = np.concatenate([[0], np.cumsum(np.ceil(lens / point.block_size).astype(np.int32))]).astype(
            np.int32
        )
        indices = np.concatenate([tables[b, : indptr[b + 1] - indptr[b]] for b in range(point.batch)])
        last = ((lens - 1) % point.block_size + 1).astype(np.int32)
        wrapper = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD")
        wrapper.plan(
            torch.from_numpy(indptr).cuda(),
            torch.from_numpy(indices.astype(np.int32)).cuda(),
            torch.from_numpy(last).cuda(),
            point.num_q_heads,
            point.num_kv_heads,
            point.head_dim,
            point.block_size,
            pos_encoding_mode="NONE",
            q_data_type=dtype,
            kv_data_type=dtype,
        )
        tq, tk, tv = tt(q), tt(k_cache), tt(v_cache)
        return lambda: wrapper.run(tq, (tk, tv))


def _workspace(
    point: SweepPoint, num_blocks: int, backend: str = "cuda", use_tensor_cores: bool | None = None
) -> Any:
    from pagedkv.attention import DecodeWorkspace

    return DecodeWorkspace(
        num_blocks=num_blocks,
        block_size=point.block_size,
        num_kv_heads=point.num_kv_heads,
        num_q_heads=point.num_q_heads,
        head_dim=point.head_dim,
        dtype=np.float16 if point.kind == "float16" else np.uint16,
        max_num_seqs=point.batch,
        max_blocks_per_seq=point.blocks_per_seq,
        backend=backend,
        split_bytes=256 << 20,
        use_tensor_cores=use_tensor_cores,
    )


def run_sweep(args: argparse.Namespace) -> int:
    import cupy
    from pagedkv.attention import paged_attention
    from pagedkv.attention.runners import get_runner

    cupy.random.seed(0)
    device = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(device.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    num_sms = int(device.attributes["MultiProcessorCount"])
    print(f"device: {name}, {num_sms} SMs, CuPy {cupy.__version__}", flush=True)
    print("1. correctness (cuda backend vs NumPy reference)", flush=True)
    failures = correctness("cuda", cupy)
    dense = DenseDecode(cupy)
    failures += dense_correctness(dense, None)
    if failures:
        print("correctness FAILED:", failures)
        return 1
    runner = get_runner("cuda")
    if getattr(runner, "fallback_reason", ""):
        print(f"   note: {runner.fallback_reason}")
    print("2. device-to-device copy bandwidth", flush=True)
    copy_bw = copy_bandwidth(cupy)
    spec: GpuSpec = lookup(name) or measured(name, num_sms, copy_bw)
    peak = spec.peak_bytes_per_s or copy_bw
    print(f"  {copy_bw / 1e9:.0f} GB/s (read + write), {100 * copy_bw / peak:.1f} % of the peak")
    print(f"   peak: {describe(spec)}")
    flush = L2Flush(cupy)
    print(f"   L2 flushed before every timed launch ({flush.bytes >> 20} MiB written)")
    flash = None
    if not args.kernel_only:
        try:
            flash = FlashInferDecode()
            print(f"   FlashInfer {flash.flashinfer.__version__} side by side")
        except Exception as exc:  # not installed, or no torch
            print(f"   FlashInfer not available ({type(exc).__name__}: {exc}); our kernel only")
    print("3. sweep", flush=True)
    header = (
        f"{'kind':<8} {'batch':>5} {'ctx':>6} {'grp':>3} {'KV GB':>7} {'splits':>6} {'cta/SM':>6} "
        f"{'waves':>5} {'us':>9} {'GB/s':>7} {'%copy':>6} {'%peak':>6} {'target':>6} {'CC us':>9} "
        f"{'TC/CC':>5} {'dense us':>9} {'dn/us':>5} {'API us':>8} {'FI us':>9} {'FI GB/s':>7} path"
    )
    print(header)
    lines = [header]
    results: list[Result] = []
    out = Path(args.out) if args.out else None
    payload: dict[str, Any] = {
        "device": name,
        "num_sms": num_sms,
        "copy_bandwidth_gb_per_s": copy_bw / 1e9,
        "gpu": asdict(spec),
        "peak_gb_per_s": peak / 1e9,
        "dense_baseline": f"{dense.backend} {dense.version}".strip(),
        "l2_flush_bytes": flush.bytes,
        "kernel_only": bool(args.kernel_only),
        "python": platform.python_version(),
        "cupy": cupy.__version__,
        "flashinfer": None if flash is None else flash.flashinfer.__version__,
        "results": [],
        "complete": False,
    }
    rng = np.random.default_rng(2)
    points = [p for p in sweep() if (not args.quick or (p.batch <= 8 and p.context <= 4096))]
    started = time.perf_counter()
    for index, p in enumerate(points):
        if time.perf_counter() - started > args.budget_s:
            note = f"budget of {args.budget_s:.0f} s spent: {len(points) - index} points not run"
            print(note)
            payload["notes"] = [note]
            break
        tables, lens, num_blocks = block_tables(p, rng)
        k_cache = random_values(cupy, (num_blocks, p.block_size, p.num_kv_heads, p.head_dim), p.kind)
        v_cache = random_values(cupy, (num_blocks, p.block_size, p.num_kv_heads, p.head_dim), p.kind)
        q = random_values(cupy, (p.batch, p.num_q_heads, p.head_dim), p.kind)
        out_buf = cupy.empty_like(q)
        ws = _workspace(p, num_blocks)
        plan = ws.plan(tables, lens)
        ctas = ws.ctas_per_sm()
        waves = math.ceil(p.batch * p.num_kv_heads * plan.num_splits / (num_sms * ctas))
        run = functools.partial(ws.run, q, k_cache, v_cache, out=out_buf)
        seconds = time_kernel(cupy, run, flush)
        gbs = p.io_bytes / seconds
        r = Result(
            asdict(p),
            p.kv_bytes / 1e9,
            seconds * 1e6,
            gbs / 1e9,
            100 * gbs / copy_bw,
            100 * gbs / peak,
            plan.num_splits,
            ctas_per_sm=ctas,
            waves=waves,
            target_pct=target_pct(p),
            kernel=ws.instance.name,
        )
        if has_cuda_core_baseline(p.kind, p.head_dim, p.group):
            # The CUDA-core kernel on the same caches, tables and output buffer, with the split
            # count the planner picks for it (its occupancy differs): what use_tensor_cores=False runs.
            ws_cc = _workspace(p, num_blocks, use_tensor_cores=False)
            r.baseline_num_splits = ws_cc.plan(tables, lens).num_splits
            run_cc = functools.partial(ws_cc.run, q, k_cache, v_cache, out=out_buf)
            cc_seconds = time_kernel(cupy, run_cc, flush)
            r.baseline_kernel = ws_cc.instance.name
            r.baseline_time_us = cc_seconds * 1e6
            r.baseline_gb_per_s = p.io_bytes / cc_seconds / 1e9
            r.tc_over_cuda_core = seconds / cc_seconds
            del ws_cc
        if (p.kind, p.batch, p.context, p.group) in SPLIT_SWEEP:
            for count in SPLIT_COUNTS:
                ws.plan(tables, lens, num_splits=count)
                t = time_kernel(cupy, run, flush, min_iters=10)
                r.split_sweep_us[str(ws.current_plan.num_splits)] = t * 1e6
            print(
                "   num_splits sweep (us): "
                + ", ".join(f"{k}: {v:.1f}" for k, v in r.split_sweep_us.items())
                + f"  (planned {plan.num_splits})"
            )
        if not args.kernel_only:
            call = functools.partial(paged_attention, q, k_cache, v_cache, tables, lens, backend="cuda")
            api = time_call(cupy, call, flush)
            r.api_time_us = api * 1e6
        if flash is not None:
            try:
                fn = flash.prepare(cupy, p, q, k_cache, v_cache, tables, lens)
                fs = time_kernel(cupy, fn, flush)
                r.flashinfer_time_us, r.flashinfer_gb_per_s = fs * 1e6, p.io_bytes / fs / 1e9
            except Exception as exc:
                r.flashinfer_note = f"{type(exc).__name__}: {exc}"[:200]
        try:  # the dense baseline: its own contiguous tensors of the same shapes
            run_dense, r.dense_backend = dense.prepare(
                p.kind, p.batch, p.num_kv_heads, p.group, p.context, p.head_dim
            )
            dense_s = time_kernel(cupy, run_dense, flush)
            r.dense_time_us, r.dense_gb_per_s = dense_s * 1e6, p.io_bytes / dense_s / 1e9
            r.dense_over_ours = dense_s / seconds
            del run_dense
        except Exception as exc:  # out of memory, a refused shape: recorded, the sweep goes on
            r.dense_note = f"{type(exc).__name__}: {exc}"[:200]
        dense.release()
        met = (
            ""
            if r.target_pct is None
            else ("met" if r.pct_of_peak >= r.target_pct else f"<{r.target_pct:.0f}")
        )
        api_us = "-" if r.api_time_us is None else f"{r.api_time_us:8.1f}"
        fi_us = "-" if r.flashinfer_time_us is None else f"{r.flashinfer_time_us:9.1f}"
        fi_gbs = "-" if r.flashinfer_gb_per_s is None else f"{r.flashinfer_gb_per_s:7.0f}"
        cc_us = "-" if r.baseline_time_us is None else f"{r.baseline_time_us:9.1f}"
        ratio = "-" if r.tc_over_cuda_core is None else f"{r.tc_over_cuda_core:5.2f}"
        dn_us = "-" if r.dense_time_us is None else f"{r.dense_time_us:9.1f}"
        dn_ratio = "-" if r.dense_over_ours is None else f"{r.dense_over_ours:5.2f}"
        line = (
            f"{p.kind:<8} {p.batch:>5} {p.context:>6} {p.group:>3} {r.kv_gb:>7.3f} {plan.num_splits:>6} "
            f"{ctas:>6} {waves:>5} {r.time_us:>9.1f} {r.gb_per_s:>7.0f} {r.pct_of_copy:>6.1f} "
            f"{r.pct_of_peak:>6.1f} {met:>6} {cc_us:>9} {ratio:>5} {dn_us:>9} {dn_ratio:>5} {api_us:>8} "
            f"{fi_us:>9} {fi_gbs:>7} "
            f"{'tc' if 'mma' in r.kernel else 'cuda'}"
        )
        print(line, flush=True)
        lines.append(line)
        results.append(r)
        payload["results"] = [asdict(x) for x in results]
        write_results(out, payload, lines)
        del k_cache, v_cache, q, out_buf, ws
        cupy.get_default_memory_pool().free_all_blocks()
    else:
        payload["complete"] = True
    payload["elapsed_s"] = time.perf_counter() - started
    write_results(out, payload, lines)
    if out is not None:
        print(f"wrote {out} and {out}.txt")
    return 0


def dry_run(args: argparse.Namespace) -> int:
    """No GPU: validate the sweep, the byte accounting and the correctness harness on the CPU,
    against the GPU the device script expects (gpu_specs.NOMINAL)."""
    spec = NOMINAL
    num_sms = spec.num_sms or 132
    points = sweep()
    check_accounting([p for p in points if p.batch * p.context <= 8 * 16384])
    rows = []
    for p in points:
        one, one_waves = planned(p, num_sms, 1)
        two, two_waves = planned(p, num_sms, 2)
        print(
            f"{p.kind:<8} batch={p.batch:>2} ctx={p.context:>5} group={p.group} "
            f"KV={p.kv_bytes / 1e9:7.3f} GB target={target_pct(p)} "
            f"{spec.name} plan: {one} splits/{one_waves} waves at 1 CTA/SM, {two}/{two_waves} at 2; "
            f"{kernel_path(p)}"
        )
        rows.append({"point": asdict(p), "splits_at_1_cta_per_sm": one, "splits_at_2_ctas_per_sm": two})
    print(f"{len(points)} sweep points; byte accounting checked")
    est = estimated_seconds(points, args.kernel_only)
    full = estimated_seconds(points, False)
    print(
        f"estimated device time (upper, {spec.name}): {est:.0f} s with these flags, {full:.0f} s "
        f"with FlashInfer and API timing; --budget-s {args.budget_s:.0f}"
    )
    failures = []
    if args.backend != "none":
        failures = correctness(args.backend, np) + dense_correctness(None, np)
    payload = {
        "dry_run": True,
        "gpu": asdict(spec),
        "estimated_seconds": est,
        "budget_s": args.budget_s,
        "plans": rows,
        "correctness_failures": failures,
        "complete": True,
    }
    write_results(Path(args.out) if args.out else None, payload, [f"{len(points)} sweep points (dry run)"])
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
        default="numpy",
        choices=["numpy", "emulated", "none"],
        help="--dry-run: backend for the correctness harness (default numpy)",
    )
    parser.add_argument("--quick", action="store_true", help="only batch <= 8 and context <= 4K")
    parser.add_argument(
        "--kernel-only",
        action="store_true",
        help="time the kernel only (no full-API timing, no FlashInfer)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="stop the sweep after this many seconds (results so far are kept)",
    )
    args = parser.parse_args(argv)
    if args.dry_run:
        return dry_run(args)
    return run_sweep(args)


if __name__ == "__main__":
    sys.exit(main())
