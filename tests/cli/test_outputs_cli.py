"""Commands' outputs: the demo's JSON and plot, a trace's attribution on stderr."""

import pytest
from pagedkv.sim import experiments

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def _write(tmp_path, text, name="trace.csv"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_demo_cli_writes_json_and_plot(run_cli, read_json, tmp_path):
    pytest.importorskip("matplotlib")
    run = run_cli(
        "demo",
        "--num-requests",
        100,
        "--json",
        tmp_path / "d.json",
        "--plot",
        tmp_path / "d.png",
        "--no-progress",
    )
    assert run.code == 0, run.err
    data = read_json(tmp_path / "d.json")
    assert set(experiments.DEMO_SECTIONS) <= set(data)
    assert (tmp_path / "d.png").stat().st_size > 10_000


def test_results_from_an_azure_trace_carry_the_cc_by_attribution(tmp_path, run_cli):
    path = _write(
        tmp_path,
        HEADER + "2023-11-16 18:15:46.6805900,40,8\n2023-11-16 18:15:47.0,30,4\n",
        name="azure_llm_2023_conv.csv",
    )
    run = run_cli("simulate", "--workload", path, "--num-slots", 512)
    assert run.code == 0, run.err
    assert "Azure Public Dataset, Microsoft (CC-BY 4.0)" in run.err
    other = run_cli(
        "simulate", "--workload", _write(tmp_path, HEADER + "0,40,8\n", name="mine.csv"), "--num-slots", 512
    )
    assert other.code == 0, other.err
    assert "Azure Public Dataset" not in other.err


def test_named_trace_works_without_any_trace_folder(run_cli, monkeypatch, read_json, tmp_path):
    """After `pip install`, outside a checkout: the bundled copy serves --workload azure-conv."""
    from pagedkv.sim import traces

    monkeypatch.delenv("PAGEDKV_TRACES", raising=False)
    monkeypatch.setattr(traces, "_repo_roots", lambda: [])
    out = tmp_path / "conv.json"
    run = run_cli(
        "simulate", "--workload", "azure-conv", "--num-requests", 100, "--json", out, "--no-progress"
    )
    assert run.code == 0, run.err
    assert "Azure Public Dataset, Microsoft (CC-BY 4.0)" in run.err
    assert read_json(out)["finished_requests"] == 100
