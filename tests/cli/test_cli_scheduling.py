"""`pagedkv simulate --scheduling`: the Mooncake workloads, the JSON's hit-rate and wait fields,
the aging bound in the printed stats, and clear refusals."""

import json

import pytest


def test_simulate_a_mooncake_trace_under_each_policy(run_cli, read_json, tmp_path):
    rates = {}
    for policy in ("fcfs", "lpm", "dfs"):
        out = tmp_path / f"{policy}.json"
        run = run_cli(
            "simulate", "--workload", "mooncake-synthetic", "--num-requests", 120, "--prefix-caching",
            "--block-size", 64, "--num-slots", 262_144, "--scheduling", policy, "--aging-bound", 64,
            "--no-progress", "--json", out,
        )  # fmt: skip
        assert run.code == 0, run.err
        assert "Mooncake trace release" in run.err  # the attribution
        data = read_json(out)
        for key in ("token_hit_rate", "optimal_token_hit_rate", "hit_rate_of_optimum", "p99_wait_s"):
            assert key in data, key
        assert data["token_hit_rate"] <= data["optimal_token_hit_rate"] + 1e-12
        assert data["config"]["scheduling"] == policy and data["finished_requests"] == 120
        assert "token hit rate" in run.out and "p99 wait (s)" in run.out
        if policy != "fcfs":
            assert "aging bound (admissions)" in run.out
            assert data["aging_bound"] == 64 and data["max_passed_over"] <= 64
        rates[policy] = data["token_hit_rate"]
    assert rates["lpm"] >= rates["fcfs"] and rates["dfs"] >= rates["fcfs"]


def test_simulate_reads_a_jsonl_path(run_cli, read_json, tmp_path):
    trace = tmp_path / "mine.jsonl"
    rows = [{"timestamp": t, "input_length": 700, "output_length": 4, "hash_ids": [1, 2]} for t in range(6)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run.json"
    run = run_cli(
        "simulate", "--workload", trace, "--prefix-caching", "--scheduling", "lpm", "--num-slots", 4096,
        "--no-progress", "--json", out,
    )  # fmt: skip
    assert run.code == 0, run.err
    data = read_json(out)
    assert data["workload"]["name"] == "mine.jsonl" and data["workload"]["distinct_prefix_blocks"] == 2
    # Six identical 700-token prompts: the first computes its 43 full blocks, the others hit them.
    assert data["prompt_hit_tokens"] == 5 * 43 * 16 == data["optimal_hit_tokens"]


def test_simulate_with_queue_aware_eviction(run_cli, read_json, tmp_path):
    out = tmp_path / "qa.json"
    run = run_cli(
        "simulate", "--workload", "system-prompt", "--num-requests", 200, "--prefix-caching",
        "--num-slots", 4096, "--scheduling", "lpm", "--queue-aware-eviction", "--no-progress", "--json", out,
    )  # fmt: skip
    assert run.code == 0, run.err
    data = read_json(out)
    assert data["config"]["queue_aware_eviction"] is True and data["finished_requests"] == 200
    assert data["token_hit_rate"] <= data["optimal_token_hit_rate"] + 1e-12


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--scheduling", "lpm"], "needs the paged allocator with prefix caching"),
        (["--scheduling", "dfs", "--prefix-caching", "--allocator", "contiguous-max"], "needs the paged"),
        (["--scheduling", "random"], "invalid choice"),
        (["--aging-bound", "-1"], "expected an integer >= 0"),
        (["--prefix-caching", "--queue-aware-eviction"], "needs scheduling 'lpm' or 'dfs'"),
    ],
)
def test_bad_scheduling_options_are_refused(run_cli, argv, message):
    run = run_cli("simulate", "--workload", "synthetic", "--num-requests", 20, "--no-progress", *argv)
    assert run.code == 2
    assert message in run.err
