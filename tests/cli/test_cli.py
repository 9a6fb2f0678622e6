"""The command line: the JSON keys of docs/design.md (Command line and result files), every
command end to end (small sizes), clear errors."""

import pagedkv
import pytest
from pagedkv import cli
from pagedkv.sim import experiments
from pagedkv.sim.names import ALLOCATOR_LABELS

PAGED = ALLOCATOR_LABELS["paged"]
MAX = ALLOCATOR_LABELS["contiguous-max"]

DESIGN_KEYS = (
    "token_states",
    "reserved",
    "internal_fragmentation",
    "external_fragmentation",
    "free",
    "mean_resident_requests",
    "peak_resident_requests",
    "preemptions",
    "finished_requests",
    "steps",
    "generated_tokens",
)
SHARES = DESIGN_KEYS[:5]


def _check_result(result, finished=None):
    for key in DESIGN_KEYS:
        assert key in result, key
    assert sum(result[key] for key in SHARES) == pytest.approx(1.0, abs=1e-6)
    assert all(result[key] >= -1e-9 for key in SHARES)
    if finished is not None:
        assert result["finished_requests"] == finished


def test_version(run_cli):
    run = run_cli("--version")
    assert run.code == 0 and run.out.strip() == f"pagedkv {pagedkv.__version__}"


def test_no_command_prints_help(run_cli):
    run = run_cli()
    assert run.code == 0 and "demo" in run.out and "simulate" in run.out and "costmodel" in run.out


@pytest.mark.parametrize("allocator", ["paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle"])
def test_simulate_json_has_the_design_keys(run_cli, read_json, tmp_path, allocator):
    out = tmp_path / "run.json"
    run = run_cli(
        "simulate", "--workload", "synthetic", "--num-requests", 120, "--allocator", allocator, "--json", out
    )
    assert run.code == 0, run.err
    data = read_json(out)
    _check_result(data, finished=120)
    assert data["config"]["allocator"] == allocator and data["workload"]["requests"] == 120
    assert "token states" in run.out


def test_simulate_a_csv_trace_with_plot(run_cli, read_json, tmp_path):
    pytest.importorskip("matplotlib")
    trace = tmp_path / "mine.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        + "".join(f"{i * 0.25},{100 + 7 * i},{5 + i % 40}\n" for i in range(80))
    )
    run = run_cli(
        "simulate",
        "--workload",
        trace,
        "--arrival",
        "trace",
        "--block-size",
        8,
        "--json",
        tmp_path / "t.json",
        "--plot",
        tmp_path / "t.png",
    )
    assert run.code == 0, run.err
    _check_result(read_json(tmp_path / "t.json"), finished=80)
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_poisson_arrivals(run_cli, read_json, tmp_path):
    run = run_cli("simulate", "--num-requests", 60, "--arrival", "poisson:5", "--json", tmp_path / "p.json")
    assert run.code == 0, run.err
    data = read_json(tmp_path / "p.json")
    assert data["config"]["arrival"] == "poisson" and data["config"]["poisson_rate"] == 5.0


def test_missing_trace_is_a_clear_error(run_cli, tmp_path):
    run = run_cli("simulate", "--workload", tmp_path / "absent.csv")
    assert run.code == 2 and "absent.csv" in run.err and "does not exist" in run.err


def test_malformed_trace_names_the_line(run_cli, tmp_path):
    trace = tmp_path / "bad.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0,10,10\n1,-5,3\n")
    run = run_cli("simulate", "--workload", trace)
    assert run.code == 2 and f"{trace}:3" in run.err and "negative" in run.err


def test_unknown_workload_name(run_cli):
    run = run_cli("simulate", "--workload", "wikipedia")
    assert run.code == 2 and "synthetic" in run.err


@pytest.mark.parametrize(
    "argv",
    [
        ["simulate", "--arrival", "sometimes"],
        ["simulate", "--arrival", "poisson:-1"],
        ["simulate", "--block-size", "0"],
        ["simulate", "--allocator", "slab"],
        ["sweep", "--block-sizes", "4,x"],
    ],
)
def test_bad_options_exit_with_usage(argv, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "usage: pagedkv" in err and "error" in err


def test_groups_exclude_each_other(run_cli):
    run = run_cli("simulate", "--parallel-samples", 2, "--beam-width", 2)
    assert run.code == 2 and "exclude" in run.err


@pytest.mark.parametrize(
    "plot, message", [("out.txt", "ending in .png"), ("nowhere/out.png", "does not exist")]
)
def test_plot_path_checked_before_running(run_cli, tmp_path, plot, message):
    run = run_cli("compare", "--plot", tmp_path / plot)
    assert run.code == 2 and message in run.err


def test_compare_all_allocators(run_cli, read_json, tmp_path):
    run = run_cli("compare", "--num-requests", 150, "--json", tmp_path / "c.json")
    assert run.code == 0, run.err
    results = read_json(tmp_path / "c.json")["results"]
    assert list(results) == [ALLOCATOR_LABELS[name] for name in experiments.ALLOCATORS]
    for result in results.values():
        _check_result(result, finished=150)
    assert results[PAGED]["token_states"] > results[MAX]["token_states"]


def test_sweep_marks_the_crossing(run_cli, read_json, tmp_path):
    run = run_cli(
        "sweep", "--num-requests", 150, "--block-sizes", "1,4,16,64,256", "--json", tmp_path / "s.json"
    )
    assert run.code == 0, run.err
    data = read_json(tmp_path / "s.json")
    assert [row["block_size"] for row in data["rows"]] == [1, 4, 16, 64, 256]
    assert 4 < data["crossing_block_size"] < 256
    assert "Waste per request equals block-table length" in run.out


def test_figure2_prints_published_shares(run_cli, read_json, tmp_path):
    run = run_cli("figure2", "--num-requests", 200, "--json", tmp_path / "f.json")
    assert run.code == 0, run.err
    for published in ("20.4 %", "26.8 %", "38.2 %", "96.3 %"):
        assert published in run.out
    data = read_json(tmp_path / "f.json")
    assert data["config"]["num_slots"] == 15_744 and data["config"]["max_model_len"] == 2048
    assert data["published_token_states"][PAGED] == 0.963


def test_costmodel_small_grid(run_cli, read_json, tmp_path):
    run = run_cli("costmodel", "--contexts", "64,256", "--block-sizes", "1,32", "--json", tmp_path / "m.json")
    assert run.code == 0, run.err
    data = read_json(tmp_path / "m.json")
    assert data["model"]["block_sizes"] == [1, 32] and len(data["cpu"]["swap_s"]) == 2
    assert "Swap wins from context" in run.out and "fitted CPU parameter" in run.out


def test_costmodel_custom_hardware(run_cli, read_json, tmp_path):
    run = run_cli("costmodel", "--skip-cpu", "--latency", "0", "--json", tmp_path / "m.json")
    assert run.code == 0, run.err
    data = read_json(tmp_path / "m.json")
    assert "cpu" not in data and data["model"]["hardware"]["per_transfer_latency_s"] == 0.0
    # Without a per-copy latency swapping wins at any block size.
    assert all(c is not None for c in data["model"]["crossover_context_tokens"])


def test_sharing_command(run_cli, read_json, tmp_path):
    run = run_cli("sharing", "--num-requests", 4, "--json", tmp_path / "sh.json")
    assert run.code == 0, run.err
    rows = read_json(tmp_path / "sh.json")["rows"]
    assert len(rows) == 12 and all(0 < row["blocks_saved"] < 1 for row in rows)


def test_a_command_group_registers_through_the_commands_list(monkeypatch, capsys):
    calls = []

    def register(subparsers):
        parser = subparsers.add_parser("hello", help="a test command")
        parser.add_argument("--name", default="world")
        parser.set_defaults(handler=lambda args: calls.append(args.name) or 0)

    monkeypatch.setattr(cli, "COMMANDS", [*cli.COMMANDS, register])
    assert cli.main(["hello", "--name", "pagedkv"]) == 0
    assert calls == ["pagedkv"]
    assert "hello" in cli.build_parser().format_help()
