"""The decode comparison of ``bench-engine --sections decode`` without a model: llama.cpp missing
is a note, not a failure; the kernel-vs-copy row measures what it says."""

from __future__ import annotations

import pytest
from pagedkv.benchmarks import decode as bench_decode


def test_missing_llama_cpp_is_a_note(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    monkeypatch.setenv("PAGEDKV_LLAMA_PYTHON", "/nonexistent/python3")
    result = bench_decode.llama_cpp_single_stream("model.gguf", 1, decode_tokens=1)
    assert "skipped" in result and "tokens_per_s" not in result


def test_kernel_vs_copy_reports_both_rates() -> None:
    row = bench_decode.kernel_vs_copy(batch=2, context=64, repeats=1)
    assert row["kv_bytes"] == 2 * 2 * 64 * 2 * 64 * 4
    assert row["attention_gb_per_s"] > 0 and row["copy_gb_per_s"] > 0


def test_print_with_and_without_llama_cpp(capsys: pytest.CaptureFixture[str]) -> None:
    kernel = {"attention_gb_per_s": 1.0, "copy_gb_per_s": 2.0, "attention_over_copy": 0.5, "kv_bytes": 1}
    result = {
        "pagedkv": {"1": {"tokens_per_s": 10.0}, "32": {"tokens_per_s": 90.0}},
        "llama_cpp": {"skipped": "llama_cpp does not run"},
        "attention_kernel": kernel,
    }
    bench_decode.print_decode_comparison(result)
    out = capsys.readouterr().out
    assert "llama.cpp: llama_cpp does not run" in out and "batch  32: 90.0 tok/s" in out
    result["llama_cpp"] = {"tokens_per_s": 30.0, "threads": 1}
    result["llama_cpp_runs"] = [result["llama_cpp"]]
    result["ratio_to_llama_cpp"] = {"1": 1 / 3, "32": 3.0}
    bench_decode.print_decode_comparison(result)
    out = capsys.readouterr().out
    assert "3.00x llama.cpp" in out and "(1 threads): 30.0 tok/s" in out
