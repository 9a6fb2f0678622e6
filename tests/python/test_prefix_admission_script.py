"""benches/prefix_admission.py stays runnable: a tiny run prints every case and every ratio the
prefix-admission targets are read from (benches/README.md, Prefix admission)."""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benches" / "prefix_admission.py"

CASES = [
    "caching off",
    "caching off, miss prompts",
    "W2 hit, events off",
    "W2 hit, events on",
    "all miss, events off",
    "all miss, events on",
    "int32 array, caching off",
    "int32, off, miss prompts",
    "int32 array, W2 hit",
    "int32 array, all miss",
    "fresh lists, caching off",
    "fresh lists, all miss",
]

RATIOS = [
    "all-miss / caching-off (events off)",
    "all-miss events on / caching-off",
    "int32 arrays: all-miss / caching-off",
    "fresh lists: all-miss / caching-off",
    "W2 hit / caching-off (same prompts)",
    "events on / off (all miss)",
]


def test_prefix_admission_script_prints_every_case_and_ratio(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", [str(BENCH), "--repeat", "2", "--iters", "3"])
    runpy.run_path(str(BENCH), run_name="__main__")
    out = capsys.readouterr().out
    for case in CASES:
        row = re.search(rf"^{re.escape(case)} +(\d+\.\d+) us per admit\+free$", out, re.M)
        assert row is not None, f"{case!r} missing:\n{out}"
        assert float(row.group(1)) > 0
    for ratio in RATIOS:
        line = re.search(rf"^{re.escape(ratio)}: (\d+\.\d+)x \(per-round median (\d+\.\d+)x\)$", out, re.M)
        assert line is not None, f"{ratio!r} missing:\n{out}"
