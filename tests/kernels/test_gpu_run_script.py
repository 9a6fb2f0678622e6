"""scripts/gpu_run.sh, the device validation run, stays runnable: its --dry-run goes through every
stage on the CPU (files, arguments, the benchmarks' dry runs, the gpu tests' collection), and a
failing stage does not stop the ones after it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_run.sh"
STAGES = ["env", "precompile", "probes", "gpu-tests", "decode", "prefill"]
DEVICE_COMMAND_S = 8 * 60  # the script's whole budget on the device machine


def _run(out: Path, *extra: str, python: str = sys.executable) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": python, "PAGEDKV_CACHE_DIR": str(out / "cache")}
    return subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", "--out", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=REPO,
    )


def _summary(out: Path) -> list[list[str]]:
    lines = (out / "summary.tsv").read_text().splitlines()
    assert lines[0].split("\t") == ["stage", "exit", "seconds", "limit_s"]
    return [line.split("\t") for line in lines[1:]]


def test_dry_run_goes_through_every_stage(tmp_path: Path) -> None:
    run = _run(tmp_path)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    rows = _summary(tmp_path)
    assert [r[0] for r in rows] == STAGES
    assert all(r[1] == "0" for r in rows), rows
    # The stage limits fit the 8 minutes, with a margin for interpreter starts.
    assert sum(int(r[3]) for r in rows) <= DEVICE_COMMAND_S - 10
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["dry_run"] is True and env["problems"] == [] and env["arch"].startswith("sm_")
    prefill = json.loads((tmp_path / "h200_prefill.json").read_text())
    assert len(prefill["rows"]) == 48 and prefill["meta"]["dry_run"] is True
    assert (tmp_path / "h200_prefill.json.txt").is_file()
    for stage in STAGES:
        assert (tmp_path / f"{stage}.log").is_file()
    assert "kernel instances for sm_90" in (tmp_path / "precompile.log").read_text()
    assert "FAIL" not in (tmp_path / "decode.log").read_text()


def test_a_failing_stage_does_not_stop_the_next(tmp_path: Path) -> None:
    # An interpreter that fails the environment check only: every later stage still runs, the
    # summary records the failure and the script exits non-zero.
    wrapper = tmp_path / "python"
    wrapper.write_text(
        '#!/bin/sh\ncase "$1" in benches/gpu_env.py) echo "env broken"; exit 3;; esac\n'
        f'exec {sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    out = tmp_path / "out"
    run = _run(out, python=str(wrapper))
    assert run.returncode == 1, run.stdout[-3000:]
    rows = _summary(out)
    assert [r[0] for r in rows] == STAGES
    assert rows[0][1] == "3" and all(r[1] == "0" for r in rows[1:]), rows


@pytest.mark.parametrize("args", [["--bogus"], ["--jobs", "0"], ["--jobs", "x"]])
def test_bad_arguments_are_refused(tmp_path: Path, args: list[str]) -> None:
    run = _run(tmp_path, *args)
    assert run.returncode == 2 and "gpu_run.sh:" in run.stderr


def test_precompile_reports_each_failure_and_keeps_compiling(monkeypatch, capsys) -> None:
    # The precompile stage: one failing instance is reported and the others still compile.
    from pagedkv.errors import KernelCompileError
    from pagedkv.kernels import cubin_cache, instances, nvrtc, precompile

    todo = instances.all_instances()[:5]
    compiled: list[str] = []

    def fake_cached_cubin(source: str, names: list[str], arch: str) -> None:
        if names[0] == todo[2].name:
            raise KernelCompileError(f"{names[0]}: error: bad\nsecond line")
        compiled.append(names[0])

    monkeypatch.setattr(instances, "all_instances", lambda: todo)
    monkeypatch.setattr(cubin_cache, "cached_cubin", fake_cached_cubin)
    monkeypatch.setattr(nvrtc, "load", lambda: None)
    assert precompile.main(["--arch", "sm_90", "--jobs", "3"]) == 1
    out = capsys.readouterr().out
    assert sorted(compiled) == sorted(i.name for i in todo if i != todo[2])
    assert out.count("FAILED ") == 1 and "second line" not in out and "1 failed" in out
    assert precompile.main(["--dry-run"]) == 0
    with pytest.raises(SystemExit):
        precompile.main(["--arch", "90"])
