"""benches/gpu_decode.py stays runnable: its --dry-run checks the sweep's byte accounting and runs
the correctness harness on the CPU (the GPU run shares that code)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from .conftest import needs_cxx

BENCH = Path(__file__).resolve().parents[2] / "benches" / "gpu_decode.py"


def test_gpu_decode_dry_run():
    run = subprocess.run(
        [sys.executable, str(BENCH), "--dry-run", "--kernel-only", "--backend", "numpy"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "54 sweep points; byte accounting checked" in run.stdout
    assert "FAIL" not in run.stdout
    # The split planner's choices on the expected GPU (gpu_specs.NOMINAL: 132 SMs) are printed per
    # point (docs/decode_kernel.md's examples among them).
    assert (
        "batch= 8 ctx= 4096 group=8 KV=  0.134 GB target=None H100 SXM plan: 2 splits/1 waves" in run.stdout
    )
    assert (
        "batch= 1 ctx= 1024 group=1 KV=  0.004 GB target=None H100 SXM plan: 8 splits/1 waves" in run.stdout
    )
    # Every group 4/8 point times the CUDA-core kernel beside the tensor-core one, and the
    # correctness step checks both kernels there (2 kinds x 2 groups x 3 split settings).
    assert run.stdout.count("tensor cores (+ CUDA-core baseline)") == 36
    assert run.stdout.count(" cuda-core: max|err|=") == 12
    assert "group=1 splits=None cuda-core" not in run.stdout
    # The windowed DecodeWorkspace case (2 kinds x 2 split settings; paged_attention on numpy).
    assert run.stdout.count(" window=100 paged_attention: max|err|=") == 4
    # The dense decode baseline's matmul form, checked against the reference on the CPU.
    assert run.stdout.count("dense baseline (numpy-matmul): max|err|=") == 2
    # The device script's 8 minutes: the estimate (an upper one) of a full run fits the budget.
    est = re.search(
        r"estimated device time \(upper, H100 SXM\): (\d+) s with these flags, (\d+) s with FlashInfer",
        run.stdout,
    )
    assert est is not None, run.stdout[-2000:]
    kernel_only, full = int(est.group(1)), int(est.group(2))
    assert 0 < kernel_only < full < 420


def test_time_estimate_counts_the_cuda_core_baseline():
    """The estimate grows with the CUDA-core baseline's timing: a point with it costs more than the
    same point at group 1 (no CUDA-core baseline; both have the dense one), by at least one
    timing's 0.2 s."""
    sys.path.insert(0, str(BENCH.parent))
    try:
        import gpu_decode
    finally:
        sys.path.remove(str(BENCH.parent))
    one = gpu_decode.SweepPoint("float16", 8, 4096, 1)
    eight = gpu_decode.SweepPoint("float16", 8, 4096, 8)
    assert gpu_decode.has_cuda_core_baseline("float16", 128, 8)
    assert not gpu_decode.has_cuda_core_baseline("float16", 128, 1)
    # Two decode instances compiled at group 8 (tensor and CUDA cores), one at group 1.
    extra = gpu_decode.estimated_seconds([eight], True) - gpu_decode.estimated_seconds([one], True)
    assert extra >= gpu_decode.EST_MIN_TIMING_S + gpu_decode.EST_COMPILE_S - 1e-9


@needs_cxx
def test_windowed_workspace_correctness_case_runs_the_workspace():
    """The device run's windowed DecodeWorkspace case, on the emulated backend (fp16 only: the
    instances test_host_path builds): no failure, and a workspace that ignored its window would
    read the released (-1) blocks."""
    sys.path.insert(0, str(BENCH.parent))
    try:
        import gpu_decode
    finally:
        sys.path.remove(str(BENCH.parent))
    assert gpu_decode.windowed_workspace_correctness("emulated", np, kinds=("float16",)) == []
