"""benches/gpu_prefill.py stays runnable: --dry-run checks the sweep's FLOP accounting and runs the
correctness harness on the CPU (the GPU run shares that code)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benches" / "gpu_prefill.py"


def test_gpu_prefill_dry_run():
    run = subprocess.run(
        [sys.executable, str(BENCH), "--dry-run", "--backend", "numpy"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "48 sweep points; FLOP accounting checked" in run.stdout
    assert "FAIL" not in run.stdout
