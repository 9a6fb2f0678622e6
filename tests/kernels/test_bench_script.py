"""benches/gpu_decode.py stays runnable: its --dry-run checks the sweep's byte accounting and runs
the correctness harness on the CPU (the GPU run shares that code)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
    # The split planner's H200 choices are printed per point (docs/decode_kernel.md's examples among them).
    assert "batch= 8 ctx= 4096 group=8 KV=  0.134 GB target=None H200 plan: 2 splits/1 waves" in run.stdout
    assert "batch= 1 ctx= 1024 group=1 KV=  0.004 GB target=None H200 plan: 8 splits/1 waves" in run.stdout
