"""benches/engine_decode_calls.py stays runnable: a tiny run prints both rows and their ratio
(benches/results/2026-12-06-engine-decode-calls.md is read from them)."""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benches" / "engine_decode_calls.py"


def test_engine_decode_calls_script_prints_both_rows_and_the_ratio(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", [str(BENCH), "--seqs", "3", "--steps", "5", "--repeat", "1"])
    runpy.run_path(str(BENCH), run_name="__main__")
    out = capsys.readouterr().out
    assert re.search(r"per-chunk calls .*: \d+\.\d us/step", out), out
    assert re.search(r"one append_tokens_batch: +\d+\.\d us/step", out), out
    assert re.search(r"ratio per-chunk / batched: \d+\.\dx", out), out
