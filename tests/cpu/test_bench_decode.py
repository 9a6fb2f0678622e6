"""The decode comparison of ``bench-engine --sections decode`` without a model or llama_cpp:
llama.cpp missing is a note, not a failure; llama.cpp's batched decode is driven as its batch API
expects (checked on a stand-in, ``fake_llama_cpp``); the ratios are taken within each run; the
runs alternate; the kernel-vs-copy row measures what it says."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from pagedkv.benchmarks import decode as bench_decode
from pagedkv.benchmarks import decode_report, llama_cpp_baseline, llama_cpp_runner

from .fake_llama_cpp import FakeLlamaCpp

KERNEL = {"attention_gb_per_s": 1.0, "copy_gb_per_s": 2.0, "attention_over_copy": 0.5, "kv_bytes": 1}


def test_missing_llama_cpp_is_a_note(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDKV_LLAMA_PYTHON", "/nonexistent/python3")
    assert set(llama_cpp_baseline.llama_cpp_single_stream("model.gguf", 1, decode_tokens=1)) == {"skipped"}
    assert set(llama_cpp_baseline.llama_cpp_batch_api("model.gguf", 1, (8,))) == {"skipped"}


def test_interpreter_without_llama_cpp_is_a_note(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "llama_cpp.py").write_text("raise ImportError('not built here')\n")
    monkeypatch.setenv("PAGEDKV_LLAMA_PYTHON", sys.executable)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    row = llama_cpp_baseline.llama_cpp_batch_api("model.gguf", 1, (8,))
    assert row["skipped"].endswith("ImportError: not built here"), row


def test_batch_api_runs_each_sequence_in_its_own_kv() -> None:
    fake = FakeLlamaCpp(vocab=500)
    row = llama_cpp_runner.measure_batch_api(fake, "m.gguf", 3, [1, 4], prompt_tokens=5, decode_tokens=6)
    assert row["threads"] == 3 and list(row["batches"]) == ["1", "4"]
    for (batch, rates), ctx in zip(row["batches"].items(), fake.contexts, strict=True):
        b = int(batch)
        assert rates["tokens"] == b * 6 and rates["tokens_per_s"] > 0 and rates["tokens_per_cpu_s"] > 0
        assert ctx.params.n_seq_max == b and ctx.params.n_threads == ctx.params.n_threads_batch == 3
        assert sorted(ctx.history) == list(range(b)) and all(len(t) == 5 + 6 for t in ctx.history.values())
        assert ctx.decodes[:b] == [[seq] * 5 for seq in range(b)]  # the prefills, one sequence each
        assert ctx.decodes[b:] == [list(range(b))] * 6  # then one token per sequence per step
        assert ctx.freed
    prompts = [tuple(t[:5]) for t in fake.contexts[1].history.values()]
    assert len(set(prompts)) == 4, "each sequence its own prompt"
    assert fake.batches_live == 0 and not fake.model_live


def test_batch_api_refuses_a_model_llama_cpp_cannot_load() -> None:
    with pytest.raises(SystemExit, match="could not load"):
        llama_cpp_runner.measure_batch_api(FakeLlamaCpp(), "missing.gguf", 1, [2], 4, 4)


def test_runner_main_prints_one_json_row(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = FakeLlamaCpp()
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    assert llama_cpp_runner.main(["single", "m.gguf", "2", "16", "7"]) == 0
    single = json.loads(capsys.readouterr().out)
    assert single["tokens"] == 7 and single["threads"] == 2 and fake.llms[0].given == 8  # the first + 7
    assert fake.llms[0].options["n_threads"] == fake.llms[0].options["n_threads_batch"] == 2
    assert llama_cpp_runner.main(["batch", "m.gguf", "2", "4", "3", "2", "8"]) == 0
    batched = json.loads(capsys.readouterr().out)
    assert {b: r["tokens"] for b, r in batched["batches"].items()} == {"2": 6, "8": 24}


def test_subprocess_runs_the_runner_in_the_named_interpreter(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The whole path: the runner's source in another interpreter whose ``llama_cpp`` is the stand-in."""
    here = Path(__file__).resolve().parent
    (tmp_path / "llama_cpp.py").write_text(
        "import sys\nfrom fake_llama_cpp import FakeLlamaCpp\nsys.modules[__name__] = FakeLlamaCpp()\n"
    )
    monkeypatch.setenv("PAGEDKV_LLAMA_PYTHON", sys.executable)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{here}")
    row = llama_cpp_baseline.llama_cpp_batch_api("m.gguf", 2, (1, 3), prompt_tokens=4, decode_tokens=2)
    assert row["threads"] == 2 and {b: r["tokens"] for b, r in row["batches"].items()} == {"1": 2, "3": 6}
    assert llama_cpp_baseline.llama_cpp_single_stream("m.gguf", 1, decode_tokens=3)["tokens"] == 3


def test_engine_threads_follows_rayon(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAYON_NUM_THREADS", "3")
    assert llama_cpp_baseline.engine_threads() == 3
    monkeypatch.setenv("RAYON_NUM_THREADS", "0")  # rayon: 0 or unset means the CPU count
    assert llama_cpp_baseline.engine_threads() >= 1


def _run(
    pagedkv: list[float], single: list[float | None], batched: list[dict[str, float] | None]
) -> dict[str, Any]:
    """One run's rows: pagedkv at 1/8/32, llama.cpp single and batched at 1 and 2 threads (None: skipped)."""
    rows = {"pagedkv": {b: {"tokens_per_s": v} for b, v in zip(("1", "8", "32"), pagedkv, strict=True)}}
    rows["llama_cpp_single"] = [
        {"skipped": "no"} if v is None else {"tokens_per_s": v, "threads": t}
        for t, v in zip((1, 2), single, strict=True)
    ]
    rows["llama_cpp_batched"] = [
        {"skipped": "no"}
        if v is None
        else {"threads": t, "batches": {b: {"tokens_per_s": x} for b, x in v.items()}}
        for t, v in zip((1, 2), batched, strict=True)
    ]
    return rows


def test_ratios_are_taken_within_each_run_against_the_faster_setting() -> None:
    run1 = _run([50, 200, 300], [40, 60], [{"1": 45, "8": 90, "32": 100}, {"1": 70, "8": 120, "32": 150}])
    run2 = _run([30, 100, 240], [50, 20], [{"1": 50, "8": 100, "32": 120}, {"1": 25, "8": 40, "32": 60}])
    run3 = _run([40, 150, 280], [55, 60], [{"1": 50, "8": 100, "32": 140}, {"1": 60, "8": 110, "32": 160}])
    result = decode_report.summarize_runs([run1, run2, run3])
    # run 1: the 2-thread baselines (60; batched 70 / 120 / 150); run 2: the 1-thread ones
    # (50; batched 50 / 100 / 120)
    assert result["runs"][0]["ratio_to_llama_cpp"] == {"1": 50 / 60, "8": 200 / 60, "32": 5.0}
    assert result["runs"][0]["ratio_to_llama_cpp_batched"] == {"1": 50 / 70, "8": 200 / 120, "32": 2.0}
    assert result["runs"][1]["ratio_to_llama_cpp_batched"] == {"1": 0.6, "8": 1.0, "32": 2.0}
    assert result["runs"][1]["llama_cpp_batched_over_single"] == {"1": 1.0, "8": 2.0, "32": 2.4}
    # medians of the within-run ratios (5.0, 4.8, 280/60), not the ratio of the medians (280/60)
    assert result["ratio_to_llama_cpp"]["32"] == 4.8
    assert result["ratio_ranges"]["ratio_to_llama_cpp"]["32"] == [pytest.approx(280 / 60), 5.0]
    assert result["ratio_to_llama_cpp_batched"]["32"] == 2.0
    assert result["ratio_ranges"]["ratio_to_llama_cpp_batched"]["32"] == [280 / 160, 2.0]
    assert result["llama_cpp_batched_over_single"]["32"] == 2.5  # of 2.5, 2.4, 160/60
    assert result["pagedkv"]["32"] == {"tokens_per_s": 280}
    assert result["llama_cpp"] == {"tokens_per_s": 60, "threads": 2}
    assert result["llama_cpp_batched"]["32"] == {"tokens_per_s": 150, "threads": 2}
    json.dumps(result)  # the bench writes it as is


def test_per_cpu_second_ratios_take_their_own_faster_setting(capsys: pytest.CaptureFixture[str]) -> None:
    """By wall time llama.cpp's 2 threads win; by CPU time (its threads spin) 1 thread does."""
    run = {
        "pagedkv": {"32": {"tokens_per_s": 300.0, "tokens_per_cpu_s": 320.0}},
        "llama_cpp_single": [
            {"threads": 1, "tokens_per_s": 40.0, "tokens_per_cpu_s": 80.0},
            {"threads": 2, "tokens_per_s": 60.0, "tokens_per_cpu_s": 35.0},
        ],
        "llama_cpp_batched": [
            {"threads": 1, "batches": {"32": {"tokens_per_s": 100.0, "tokens_per_cpu_s": 200.0}}},
            {"threads": 2, "batches": {"32": {"tokens_per_s": 150.0, "tokens_per_cpu_s": 90.0}}},
        ],
    }
    result = decode_report.summarize_runs([run])
    assert result["ratio_to_llama_cpp"] == {"32": 5.0} and result["ratio_to_llama_cpp_batched"] == {"32": 2.0}
    cpu = result["per_cpu_s"]
    assert cpu["ratio_to_llama_cpp"] == {"32": 4.0} and cpu["ratio_to_llama_cpp_batched"] == {"32": 1.6}
    assert cpu["llama_cpp_batched_over_single"] == {"32": 2.5}
    assert result["runs"][0]["per_cpu_s"]["ratio_to_llama_cpp_batched"] == {"32": 1.6}
    assert result["pagedkv"]["32"] == {"tokens_per_s": 300.0, "tokens_per_cpu_s": 320.0}
    assert result["llama_cpp"] == {
        "tokens_per_s": 60.0,
        "tokens_per_cpu_s": 35.0,
        "threads": 2,
    }  # the wall-faster
    decode_report.print_decode_comparison(result | {"attention_kernel": KERNEL, "threads": 2})
    out = capsys.readouterr().out
    assert "    per CPU-second: 4.00x single [4.00-4.00], 1.60x batched at 32 [1.60-1.60]\n" in out


def test_summary_without_llama_cpp_keeps_the_notes(capsys: pytest.CaptureFixture[str]) -> None:
    result = decode_report.summarize_runs([_run([10, 50, 90], [None, None], [None, None])] * 2)
    assert result["llama_cpp"] == {"skipped": "no"} and result["llama_cpp_batched"] == {"skipped": "no"}
    assert all(result[key] == {} for key in decode_report.RATIO_KEYS)
    decode_report.print_decode_comparison(result | {"attention_kernel": KERNEL, "threads": 2})
    out = capsys.readouterr().out
    assert "llama.cpp: no" in out and "llama.cpp batched: no" in out and "batch  32: 90.0 tok/s\n" in out


def test_single_stream_without_batch_api_still_gives_its_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    result = decode_report.summarize_runs([_run([10, 50, 90], [None, 30], [None, None])])
    assert result["ratio_to_llama_cpp"]["32"] == 3.0 and result["ratio_to_llama_cpp_batched"] == {}
    decode_report.print_decode_comparison(result | {"attention_kernel": KERNEL, "threads": 2})
    out = capsys.readouterr().out
    assert "batch  32: 90.0 tok/s = 3.00x llama.cpp's single stream [3.00-3.00]\n" in out
    assert "llama.cpp single stream: 30.0 tok/s (2 threads)" in out and "llama.cpp batched: no" in out


def test_print_states_both_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    run = _run([50, 200, 300], [40, 60], [{"1": 45, "8": 90, "32": 100}, {"1": 70, "8": 120, "32": 150}])
    result = decode_report.summarize_runs([run])
    decode_report.print_decode_comparison(result | {"attention_kernel": KERNEL, "threads": 2})
    out = capsys.readouterr().out
    assert (
        "batch  32: 300.0 tok/s = 5.00x llama.cpp's single stream [5.00-5.00], 2.00x llama.cpp batched at 32"
        in out
    )
    assert "llama.cpp batched at  32: 150.0 tok/s (2 threads) = 2.50x its single stream" in out
    assert "run 1: pagedkv 1/8/32: 50.0 / 200.0 / 300.0 tok/s" in out


def test_runs_alternate_and_a_missing_llama_cpp_is_asked_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def drive(model: object, batch: int) -> dict[str, float]:
        calls.append(f"pagedkv {batch}")
        return {"tokens_per_s": 10.0 * batch}

    def single(path: str, threads: int) -> dict[str, Any]:
        calls.append(f"single {threads}")
        return {"tokens_per_s": 20.0, "threads": threads} if available else {"skipped": "absent"}

    def batched(path: str, threads: int, batches: tuple[int, ...], *_: int) -> dict[str, Any]:
        calls.append(f"batched {threads}")
        rows = {str(b): {"tokens_per_s": 15.0 * b} for b in batches}
        return {"threads": threads, "batches": rows} if available else {"skipped": "absent"}

    monkeypatch.setattr(bench_decode, "drive_decode", drive)
    monkeypatch.setattr(bench_decode, "llama_cpp_single_stream", single)
    monkeypatch.setattr(bench_decode, "llama_cpp_batch_api", batched)
    monkeypatch.setattr(bench_decode, "kernel_vs_copy", lambda: KERNEL)
    monkeypatch.setattr(bench_decode, "engine_threads", lambda: 2)
    model: Any = types.SimpleNamespace(model=types.SimpleNamespace(weight_dtype="int8"))
    available = True
    result = bench_decode.decode_comparison(model, "m.gguf", batches=(1, 8), runs=2)
    pagedkv, llama = ["pagedkv 1", "pagedkv 8"], ["single 1", "single 2", "batched 1", "batched 2"]
    assert calls == pagedkv + llama + llama + pagedkv
    assert result["threads"] == 2 and result["weights"] == "int8" and len(result["runs"]) == 2
    assert result["ratio_to_llama_cpp_batched"] == {"1": 10 / 15, "8": 80 / 120}
    assert result["ratio_to_llama_cpp"] == {"1": 0.5, "8": 4.0}
    calls.clear()
    available = False
    result = bench_decode.decode_comparison(model, "m.gguf", batches=(1, 8), runs=3)
    assert calls == pagedkv + llama + pagedkv + pagedkv
    assert result["llama_cpp"] == {"skipped": "absent"} and result["ratio_to_llama_cpp"] == {}


def test_kernel_vs_copy_reports_both_rates() -> None:
    row = bench_decode.kernel_vs_copy(batch=2, context=64, repeats=1)
    assert row["kv_bytes"] == 2 * 2 * 64 * 2 * 64 * 4
    assert row["attention_gb_per_s"] > 0 and row["copy_gb_per_s"] > 0
