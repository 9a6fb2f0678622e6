"""scripts/gpu_run.sh, the device validation run, is ready for the machine it will meet.

Its --dry-run goes through every stage on the CPU (the setup check, the instance list, the gpu
tests' collection, the sanitizer cases and both benchmarks on the NumPy reference) and leaves
what the device run leaves: one results JSON and one log. The other tests run the script with a
stand-in interpreter whose stages fail, time out or sleep on purpose (in seconds, not minutes):
a failing stage does not stop the next, a timed-out stage keeps what it wrote, a failed setup
stops the run with one line, and no stage outlives the budget.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_run.sh"
STAGES = ["setup", "precompile", "probes", "gpu-tests", "sanitizer", "decode", "prefill"]
DEVICE_COMMAND_S = 8 * 60  # the bound on the whole run


def _run(
    out: Path,
    *extra: str,
    python: str = sys.executable,
    env: dict[str, str] | None = None,
    dry_run: bool = True,
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": python, "PAGEDKV_CACHE_DIR": str(out.parent / "cache"), **(env or {})}
    return subprocess.run(
        ["bash", str(SCRIPT), *(["--dry-run"] if dry_run else []), "--out", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=REPO,
    )


def _results(out: Path) -> dict:
    return json.loads((out / "gpu_run.json").read_text())


def test_dry_run_goes_through_every_stage_into_one_json_and_one_log(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = _run(out)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    # What comes back from the device: two files, nothing named after one GPU.
    assert sorted(p.name for p in out.iterdir()) == ["gpu_run.json", "gpu_run.log"]
    results = _results(out)
    assert results["complete"] is True and results["dry_run"] is True
    stages = {s["name"]: s for s in results["stages"]}
    assert [s["name"] for s in results["stages"]] == STAGES == results["stages_planned"]
    assert all(s["status"] == "passed" and s["exit"] == 0 for s in stages.values()), stages
    # Worst case: every stage at its limit, the last one killed after the grace period.
    assert sum(s["limit_s"] for s in stages.values()) <= results["budget_s"]
    assert results["budget_s"] + results["kill_after_s"] + 10 <= DEVICE_COMMAND_S
    setup = stages["setup"]["result"]
    assert setup["dry_run"] is True and setup["problems"] == [] and setup["arch"].startswith("sm_")
    assert results["gpu"]["name"] == "H100 SXM" and results["gpu"]["source"] == "assumed"
    assert "kernel instances for sm_90" in "\n".join(stages["precompile"]["log_tail"])
    assert stages["probes"]["junit"]["failed"] == [] and stages["gpu-tests"]["junit"]["failed"] == []
    assert len(stages["sanitizer"]["result"]["cases"]) == 3 and stages["sanitizer"]["result"]["failed"] == 0
    decode = stages["decode"]["result"]
    assert len(decode["plans"]) == 54 and decode["correctness_failures"] == []
    prefill = stages["prefill"]["result"]
    assert len(prefill["rows"]) == 48 and prefill["meta"]["dry_run"] is True
    log = (out / "gpu_run.log").read_text()
    for stage in STAGES:
        assert f"== {stage} (limit " in log
    assert "dense baseline (numpy-matmul)" in log and "FAIL" not in log
    assert "h200" not in json.dumps(results).lower()


# A stand-in interpreter: stages named in STAGE_BEHAVIOUR fail, sleep or fake their output;
# everything else (the results folding, one-line queries) runs on the real interpreter.
STAND_IN = """#!/bin/sh
echo "stand-in argv: $*" >&2
case "$1 $2" in
  "benches/gpu_env.py "*)
    out=$(echo "$@" | sed 's/.*--out //')
    [ "$FAKE_SETUP" = fail ] && { echo "SETUP FAILED: no CUDA driver (stand-in)"; exit 1; }
    echo "{\\"arch\\": \\"sm_90\\", \\"compute_sanitizer\\": \\"$FAKE_SANITIZER\\"}" > "$out"
    echo "setup ok (stand-in)"; exit 0 ;;
  "-m pytest"|"-m pagedkv.kernels.precompile") exit 0 ;;
  "benches/gpu_sanitize.py "*) echo "sanitizer cases broken (stand-in)"; exit 3 ;;
  "benches/gpu_decode.py "*)
    out=$(echo "$@" | sed 's/.*--out //')
    echo '{"results": [{"point": 1}], "complete": false}' > "$out"
    echo "one point written, then stuck"; exec sleep 60 ;;
  "benches/gpu_prefill.py "*)
    out=$(echo "$@" | sed 's/.*--out //')
    echo '{"rows": [], "complete": true}' > "$out"; echo "prefill (stand-in)"; exit 0 ;;
esac
exec PYTHON_BIN "$@"
"""


def _stand_in(tmp_path: Path) -> str:
    path = tmp_path / "python"
    path.write_text(STAND_IN.replace("PYTHON_BIN", sys.executable))
    path.chmod(0o755)
    return str(path)


def test_a_failing_or_timed_out_stage_keeps_its_results_and_the_next_runs(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = _run(out, python=_stand_in(tmp_path), env={"PAGEDKV_GPU_RUN_STAGE_CAP_S": "5"})
    assert run.returncode == 1, run.stdout[-3000:]
    results = _results(out)
    stages = {s["name"]: s for s in results["stages"]}
    assert [s["name"] for s in results["stages"]] == STAGES
    assert stages["sanitizer"]["status"] == "failed" and stages["sanitizer"]["exit"] == 3
    assert "sanitizer cases broken (stand-in)" in stages["sanitizer"]["log_tail"]
    # The decode stage overran its (capped) limit: its point so far is in the results.
    assert stages["decode"]["status"] == "timed out" and stages["decode"]["exit"] in (124, 137)
    assert stages["decode"]["result"] == {"results": [{"point": 1}], "complete": False}
    assert "one point written, then stuck" in (out / "gpu_run.log").read_text()
    assert stages["prefill"]["status"] == "passed" and results["complete"] is True


def test_a_failed_setup_stops_the_run_with_one_line(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = _run(out, python=_stand_in(tmp_path), env={"FAKE_SETUP": "fail"})
    assert run.returncode == 1
    assert "gpu_run.sh: SETUP FAILED: no CUDA driver (stand-in)" in run.stdout
    stages = _results(out)["stages"]
    assert [s["name"] for s in stages] == STAGES
    assert stages[0]["status"] == "failed"
    assert all(s["status"] == "skipped" and s["note"] == "setup failed" for s in stages[1:])


def test_no_stage_outlives_the_budget(tmp_path: Path) -> None:
    # The budget at a scale a test can wait for: a stage that would sleep past what is left of it
    # is cut there, and every stage after it is skipped, saying so.
    stand_in = _stand_in(tmp_path)
    slow = Path(stand_in).read_text().replace('"-m pytest"|', '"-m pytest") exec sleep 60 ;;\n  ')
    Path(stand_in).write_text(slow)
    out = tmp_path / "out"
    run = _run(out, python=stand_in, env={"PAGEDKV_GPU_RUN_BUDGET_S": "8"})
    assert run.returncode == 1, run.stdout[-3000:]
    results = _results(out)
    stages = {s["name"]: s for s in results["stages"]}
    assert stages["probes"]["status"] == "timed out" and stages["probes"]["limit_s"] <= 8
    assert all(stages[n]["status"] == "skipped" for n in STAGES[3:]), stages
    assert "budget is spent" in stages["decode"]["note"]
    assert results["elapsed_s"] <= 8 + results["kill_after_s"] + 2


def test_the_device_branch_gives_each_stage_its_arguments(tmp_path: Path) -> None:
    # The commands only the GPU machine runs, with stand-ins for the tools (compute-sanitizer too).
    sanitizer = tmp_path / "compute-sanitizer"
    sanitizer.write_text('#!/bin/sh\necho "sanitizer argv: $*"\nexit 0\n')
    sanitizer.chmod(0o755)
    out = tmp_path / "out"
    env = {"FAKE_SANITIZER": str(sanitizer), "PAGEDKV_GPU_RUN_STAGE_CAP_S": "5"}
    run = _run(out, "--jobs", "16", python=_stand_in(tmp_path), env=env, dry_run=False)
    assert run.returncode == 1, run.stdout[-3000:]  # the stand-in decode stage times out
    log = (out / "gpu_run.log").read_text()
    expected = [
        "stand-in argv: benches/gpu_env.py --out ",
        "stand-in argv: -m pagedkv.kernels.precompile --arch sm_90 --jobs 16",
        "-m pytest -q -p no:cacheprovider -o addopts=-ra -m gpu tests/kernels/test_gpu_mma.py --junitxml=",
        "tests/kernels/test_gpu.py tests/kernels/test_gpu_prefill.py --junitxml=",
        "sanitizer argv: --tool memcheck --error-exitcode 86 --print-limit 20 ",
        "stand-in argv: benches/gpu_decode.py --kernel-only --budget-s 85 --out ",
        "stand-in argv: benches/gpu_prefill.py --budget-s 45 --out ",
    ]
    for text in expected:
        assert text in log, text
    assert "--dry-run" not in log.split("== setup")[1]
    stages = {s["name"]: s for s in _results(out)["stages"]}
    assert (
        stages["sanitizer"]["status"] == "passed"
        and stages["sanitizer"]["note"] == "compute-sanitizer memcheck"
    )
    # Without the tool the stage is skipped, saying why, and the run goes on.
    run = _run(out, python=_stand_in(tmp_path), env={"PAGEDKV_GPU_RUN_STAGE_CAP_S": "5"}, dry_run=False)
    stages = {s["name"]: s for s in _results(out)["stages"]}
    assert (
        stages["sanitizer"]["status"] == "skipped"
        and "compute-sanitizer not found" in stages["sanitizer"]["note"]
    )
    assert stages["prefill"]["status"] == "passed"


@pytest.mark.parametrize("args", [["--bogus"], ["--jobs", "0"], ["--jobs", "x"]])
def test_bad_arguments_are_refused(tmp_path: Path, args: list[str]) -> None:
    run = _run(tmp_path / "out", *args)
    assert run.returncode == 2 and "gpu_run.sh:" in run.stderr


def test_the_gpu_is_found_in_a_table_or_measured() -> None:
    sys.path.insert(0, str(REPO / "benches"))
    try:
        import gpu_specs
    finally:
        sys.path.remove(str(REPO / "benches"))
    names = {
        "NVIDIA H100 80GB HBM3": "H100 SXM",
        "NVIDIA H100 PCIe": "H100 PCIe",
        "NVIDIA H100 NVL": "H100 NVL",
        "NVIDIA H200": "H200 SXM",
        "NVIDIA H200 NVL": "H200 NVL",
    }
    for device, row in names.items():
        spec = gpu_specs.lookup(device)
        assert spec is not None and spec.name == row and spec.source == "table", device
    assert gpu_specs.lookup("NVIDIA H100 80GB HBM3").peak_bytes_per_s == 3.35e12
    for unknown in ("NVIDIA GH200 480GB", "NVIDIA A100-SXM4-80GB", "NVIDIA L4"):
        assert gpu_specs.lookup(unknown) is None
    spec = gpu_specs.measured("NVIDIA L4", 58, 2.4e11)
    assert spec.source == "measured" and spec.peak_bytes_per_s == 2.4e11 and spec.peak_flops is None


def test_no_benchmark_or_run_file_is_written_for_one_gpu() -> None:
    # Peaks live in gpu_specs' table only; no h200_* result names or H200 constants elsewhere.
    files = [SCRIPT, *sorted((REPO / "benches").glob("gpu_*.py"))]
    for path in files:
        if path.name == "gpu_specs.py":
            continue
        text = path.read_text()
        assert not re.search(r"h200_|H200_|H200 plan|4\.8e12|989e12|4\.8 TB/s", text), path


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
