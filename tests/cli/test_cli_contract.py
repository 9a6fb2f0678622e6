"""The command line keeps its word: every output it promises is written, every flag it takes
applies, every refusal is one line with exit status 2 (never a traceback), and a closed pipe
ends it quietly."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pagedkv.attention  # a subpackage the namespace checks read; binds `pagedkv` too
import pytest
from pagedkv import cli
from pagedkv.commands import output
from pagedkv.sim import experiments
from pagedkv.sim.engine import SimConfig, record_frames
from pagedkv.sim.names import ALLOCATOR_LABELS

PNG = b"\x89PNG\r\n\x1a\n"
REPO = Path(__file__).resolve().parents[2]
SMALL = ["--num-requests", "40", "--no-progress"]


def run(argv, capsys):
    code = cli.main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return code, captured.out, captured.err


def test_recovery_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "recovery.png"
    code, out, err = run(["recovery", *SMALL, "--num-slots", 2048, "--plot", path], capsys)
    assert code == 0, err
    assert path.read_bytes()[:8] == PNG and f"wrote {path}" in out


def test_demo_cuda_backend_without_cupy_is_a_clean_error(monkeypatch, capsys):
    from pagedkv.attention import runners

    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    monkeypatch.setattr(runners, "_cuda", None)
    code, out, err = run(["demo", "--attention-backend", "cuda", "--no-progress"], capsys)
    assert code == 2
    assert "needs CuPy and a CUDA GPU" in err and "pip install" in err
    assert "===" not in out  # refused before any section ran


@pytest.mark.parametrize(
    "argv",
    [
        ["compare", "--allocator", "paged"],
        ["sweep", "--allocator", "contiguous-max"],
        ["sweep", "--block-size", "32"],
        ["recovery", "--preemption", "swap"],
        ["recovery", "--allocator", "paged"],
    ],
)
def test_flags_that_do_not_apply_are_refused(argv, capsys):
    code, out, err = run([*argv, *SMALL], capsys)
    assert code == 2
    assert f"unrecognized arguments: {argv[1]}" in err and not out


def test_a_closed_pipe_ends_the_command_quietly():
    """`pagedkv sweep | head`: the reader is gone before the tables are written."""
    process = subprocess.Popen(
        [sys.executable, "-m", "pagedkv", "sweep", *SMALL, "--block-sizes", "1,2,4,8,16,32,64,128"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()
    err = process.stderr.read().decode()
    process.stderr.close()
    assert process.wait(timeout=120) == 141
    assert err == ""


def test_the_paged_allocator_has_one_name_in_every_table(capsys):
    label = ALLOCATOR_LABELS["paged"]
    for argv in (["simulate", *SMALL], ["compare", *SMALL]):
        code, out, err = run(argv, capsys)
        assert code == 0, err
        assert label in out
        assert "vLLM" not in out.replace(label, "")
        assert "paged (block" not in out


def test_waste_is_one_share_of_the_pool_in_tables_and_visualizer():
    from pagedkv.sim import workloads

    workload = workloads.synthetic(30, seed=2)
    for allocator in ("paged", "contiguous-pow2"):
        config = SimConfig(allocator=allocator, num_slots=2048, max_model_len=1024)
        summary = experiments.summarize(experiments.run_simulation(workload, config))
        recording = record_frames(workload, config, max_steps=100_000)
        frames = recording["frames"]
        assert len(frames) == summary["steps"]
        for frame in frames[:50]:
            wasted = frame["reserved_slots"] + frame["internal_frag_slots"] + frame["external_frag_slots"]
            assert frame["waste_pct"] == pytest.approx(100 * wasted / config.num_slots)
        # The tables' waste is the time average of the visualizer's, step by step.
        mean_pct = np.mean([frame["waste_pct"] for frame in frames])
        assert mean_pct / 100 == pytest.approx(summary["waste"], abs=1e-9)


def test_package_namespace_holds_no_annotations_import():
    for module in (pagedkv, pagedkv.sim, pagedkv.sim.experiments, pagedkv.viz, pagedkv.attention):
        assert "annotations" not in dir(module), module.__name__
    public = {name for name in dir(pagedkv) if not name.startswith("_")}
    subpackages = {
        "attention",
        "benchmarks",
        "cli",
        "commands",
        "disagg",
        "engine",
        "errors",
        "events",
        "integrations",
        "kernels",
        "models",
        "offload",
        "sim",
        "transfer",
        "viz",
    }
    assert public - subpackages == set(pagedkv.__all__) - {"__version__"}


def test_plot_without_matplotlib_gives_advice_for_a_source_install(monkeypatch, tmp_path, capsys):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a),
    )
    code, out, err = run(["simulate", *SMALL, "--plot", tmp_path / "p.png"], capsys)
    assert code == 2 and not out
    assert "pip install matplotlib" in err and "'.[plot]'" in err
    assert "pagedkv[plot]" not in err


def test_costmodel_marks_extrapolations_past_its_table(capsys):
    code, out, err = run(["costmodel", "--skip-cpu", "--contexts", "128,1024", "--block-sizes", "16"], capsys)
    assert code == 0, err
    assert "block 16: 32,131+" in out and "+ beyond the largest context in this table (1,024 tokens)" in out
    assert "computed from the formulas, not measured" in out
    assert "e-0" not in out and "e+0" not in out  # fixed-point milliseconds, no scientific notation


def test_sharing_marks_where_ours_differ_from_the_published_range():
    from pagedkv.sim.experiments.sharing import compare_with_published, render_sharing

    assert compare_with_published(0.08, (0.061, 0.098)) == "within"
    assert compare_with_published(0.05, (0.061, 0.098)) == "below by 1.1 pts"
    assert compare_with_published(0.60, (0.376, 0.552)) == "above by 4.8 pts"
    assert compare_with_published(0.60, None) == "-"
    row = {"workload": "alpaca", "kind": "beam", "width": 4, "blocks_saved": 0.6, "cow_copies": 1}
    row.update(mean_logical_blocks=10.0, mean_physical_blocks=4.0)
    text = render_sharing(
        {"block_size": 16, "num_requests": 1, "rows": [row], "published": {"beam": [0.376, 0.552]}}
    )
    assert "above by 4.8 pts" in text and "1 row(s) fall outside it" in text


def _words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z-]+", text.lower()) if len(w) >= 5}


def test_the_demo_prints_the_sections_its_docs_name(capsys):
    # What README's command table and docs/experiments.md promise (six sections, in this order,
    # "a few seconds") against what `pagedkv demo` prints: a section dropped, added or reordered,
    # or a doc that drifts, fails here. (The runtime is not asserted: tests never time.)
    assert cli.main(["demo"]) == 0
    headings = re.findall(r"^=== \(([a-z])\) (.*) \(\d+\.\d s\)$", capsys.readouterr().out, flags=re.M)
    assert [letter for letter, _ in headings] == list("abcdef"), headings
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    [row] = [line for line in readme.splitlines() if line.startswith("| `pagedkv demo` |")]
    items = row.split("a few seconds:")[1].split("|")[0].split(";")
    assert len(items) == len(headings)
    for item, (letter, heading) in zip(items, headings, strict=True):
        assert _words(item) & _words(heading), (
            f"README names {item.strip()!r} where ({letter}) is {heading!r}"
        )
    experiments = (REPO / "docs" / "experiments.md").read_text(encoding="utf-8")
    assert "| `pagedkv demo` | the whole story in six sections, in a few seconds |" in experiments
    for text in (readme, experiments, cli.build_parser().format_help()):
        demo_lines = [line for line in text.splitlines() if "demo" in line and "seconds" in line]
        assert demo_lines and all("a few seconds" in line for line in demo_lines), demo_lines


def _stub(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


def test_the_test_script_keeps_the_users_venv_and_prints_its_runtime(tmp_path):
    # scripts/test.sh run for real, every tool replaced by a stub that logs its call: the user's
    # .venv survives, .venv-test is rebuilt, every stage runs in order, the runtime is printed,
    # and a failing stage fails the script.
    (tmp_path / "scripts").mkdir()
    for name in ("test.sh", "interop.sh"):
        (tmp_path / "scripts" / name).write_bytes((REPO / "scripts" / name).read_bytes())
        (tmp_path / "scripts" / name).chmod(0o755)
    (tmp_path / "rust" / "interop-tests").mkdir(parents=True)
    # The vLLM stage builds a cached vLLM venv (scripts/vllm/env.sh): a stub that logs its call.
    (tmp_path / "scripts" / "vllm").mkdir()
    (tmp_path / "scripts" / "vllm" / "stage.sh").write_text(
        f'echo "vllm-stage $*" >> {tmp_path / "calls.log"}\n'
    )
    # The callgrind gate builds and measures the bench binary under valgrind: a stub too.
    (tmp_path / "scripts" / "callgrind_gate.sh").write_text(
        f'echo "callgrind-gate $*" >> {tmp_path / "calls.log"}\n'
    )
    (tmp_path / "scripts" / "callgrind_gate.sh").chmod(0o755)
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "mine").write_text("keep")
    (tmp_path / ".venv-test").mkdir()
    (tmp_path / ".venv-test" / "stale").write_text("old")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    record = f'echo "$(basename "$0") $*" >> {log}\n'
    _stub(
        bin_dir,
        "python3",
        record + 'if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin"; : > "$3/bin/activate"; fi\n',
    )
    # apt-get: the Redis server install; maturin: the bindings built without the direct int reader
    for tool in ("python", "cargo", "ruff", "mypy", "apt-get", "maturin"):
        _stub(bin_dir, tool, record + f'[ "$FAIL_TOOL" = "{tool} $1 $2" ] && exit 7\nexit 0\n')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    env.pop("VIRTUAL_ENV", None)
    run = subprocess.run(["bash", "scripts/test.sh"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / ".venv" / "mine").read_text() == "keep"
    assert (tmp_path / ".venv-test").is_dir() and not (tmp_path / ".venv-test" / "stale").exists()
    assert re.search(r"^scripts/test\.sh passed in \d+ s$", run.stdout, flags=re.M), run.stdout
    calls = log.read_text().splitlines()
    order = ["python3 -m venv .venv-test", "cargo fmt", "ruff format", "mypy", "cargo test --workspace"]
    order += [
        "callgrind-gate",
        "cargo test --release --locked",
        "python -m pytest",
        "maturin build",
        "vllm-stage",
    ]
    positions = [next(i for i, call in enumerate(calls) if call.startswith(step)) for step in order]
    assert positions == sorted(positions), calls
    failing = subprocess.run(
        ["bash", "scripts/test.sh"],
        cwd=tmp_path,
        env={**env, "FAIL_TOOL": "mypy  "},
        capture_output=True,
        text=True,
    )
    assert failing.returncode != 0 and "passed in" not in failing.stdout


# ---------------------------------------------------------------- bounded numbers, clean refusals


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["simulate", "--max-model-len", "99999999999999999999"], "--max-model-len"),
        (["simulate", "--num-slots", "99999999999999999999"], "--num-slots"),
        (["simulate", "--max-steps", "99999999999999999999"], "--max-steps"),
        (["viz", "--max-steps", "99999999999999999999"], "--max-steps"),
        (["viz", "--max-steps", str(2**40)], "max_steps must be an integer in [1, 100,000]"),
        (["costmodel", "--contexts", ","], "--contexts"),
        (["costmodel", "--block-sizes", ""], "--block-sizes"),
        (["demo", "--num-requests", str(10**15)], "--num-requests"),
        (["figure2", "--num-requests", str(10**15)], "--num-requests"),
        (["sharing", "--num-requests", str(10**15)], "--num-requests"),
        (["simulate", "--num-requests", "1_000"], "expected an integer, got '1_000'"),
        (["simulate", "--num-requests", "\u0661\u0662"], "expected an integer"),  # Arabic-Indic 12
        (["simulate", "--num-slots", "\uff11\uff12\uff13"], "expected an integer"),  # fullwidth 123
        (["sweep", "--block-sizes", "4,1_6"], "--block-sizes"),
        (["simulate", "--json", ""], "--json: the file name is empty"),
        (["simulate", "--plot", ""], "--plot: the file name is empty"),
    ],
)
def test_bounded_and_strict_numbers(argv, expected, capsys):
    code, _, err = run([*argv, "--no-progress"] if argv[0] != "costmodel" else [*argv, "--skip-cpu"], capsys)
    assert code == 2
    assert expected in err, err


def test_unwritable_json_fails_before_the_run(tmp_path, capsys):
    for path in (tmp_path, tmp_path / "missing" / "x.json", Path("/proc/pagedkv-test.json")):
        code, out, err = run(["simulate", *SMALL, "--json", path], capsys)
        assert code == 2 and "--json" in err, err
        assert out == "", "the simulation must not run"
    assert not any(tmp_path.iterdir())


def test_a_50_mb_trace_field_is_not_echoed_whole(tmp_path, capsys):
    path = tmp_path / "big.csv"
    field = "9" * 50_000_000
    path.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n0,{field}x,5\n", encoding="ascii")
    code, _, err = run(["simulate", "--workload", path, "--no-progress"], capsys)
    assert code == 2 and f"{path.name}:2:" in err
    assert len(err) < 1_000 and "50,000,001 characters" in err


@pytest.mark.parametrize(
    "rows, line",
    [
        ("0,10,5\n1e300,10,5\n", 3),
        ("1e300,10,5\n0,10,5\n", 2),
        ("2023-01-01 00:00:00,10,5\n-1e15,10,5\n", 2),
    ],
)
def test_huge_timestamp_gaps_name_file_and_line(tmp_path, capsys, rows, line):
    path = tmp_path / "gaps.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + rows, encoding="ascii")
    code, _, err = run(["simulate", "--workload", path, "--arrival", "trace", "--no-progress"], capsys)
    assert code == 2
    assert f"{path}:" in err and "a trace may span at most" in err
    assert f"{path}:{line}:" in err or f"(line {line})" in err, err


@pytest.mark.parametrize("count", ["1_000", "\u0661\u0662", "\uff11\uff12", "+-3", "0x10"])
def test_trace_counts_are_ascii_decimal(tmp_path, capsys, count):
    path = tmp_path / "counts.csv"
    path.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n0,{count},5\n", encoding="utf-8")
    code, _, err = run(["simulate", "--workload", path, "--no-progress"], capsys)
    assert code == 2 and f"{path.name}:2: token counts must be integers" in err, err


def test_output_checks_leave_no_file_behind(tmp_path):
    target = tmp_path / "new.json"
    output.check_json_path(str(target))
    assert not target.exists()
    target.write_text("keep", encoding="utf-8")
    output.check_json_path(str(target))
    assert target.read_text(encoding="utf-8") == "keep"
    os.chmod(target, 0o644)


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["viz", "--block-sizes", "4,1_6"], "--block-sizes: expected comma-separated integers"),
        (["viz", "--seeds", "\u0661"], "--seeds: expected comma-separated integers"),
        (["viz", "--port", "70000"], "--port"),
        (["viz", "--port", "8_080"], "--port"),
        (["viz", "--serve-seconds", "nan"], "--serve-seconds"),
    ],
)
def test_viz_lists_and_numbers_are_strict(argv, expected, tmp_path, capsys):
    code, _, err = run([*argv, "--out", tmp_path / "v.html", "--no-progress"], capsys)
    assert code == 2 and expected in err, err
    assert not (tmp_path / "v.html").exists()
