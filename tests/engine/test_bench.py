"""``pagedkv bench-engine``'s runner on a tiny workload: both engines generate the same tokens,
and the numbers are handed to ``checkpoint`` after each engine run, so an interrupted long run
keeps its finished half."""

from __future__ import annotations

import copy
import json

import numpy as np


def test_throughput_checkpoints_after_each_engine(smollm, tmp_path):
    from pagedkv.benchmarks.engine import run_benchmark
    from pagedkv.commands.output import write_json

    saved: list[dict] = []
    result = run_benchmark(
        smollm,
        num_requests=3,
        num_blocks=8,
        block_size=16,
        max_model_len=32,
        max_prompt=8,
        max_output=2,
        sections=("throughput",),
        checkpoint=lambda partial: saved.append(copy.deepcopy(partial)),
    )
    assert [sorted(s.get("throughput", {})) for s in saved] == [
        ["paged"],
        ["contiguous", "mean_batch_ratio", "paged", "tokens_per_cpu_s_ratio", "tokens_per_s_ratio"],
    ]
    assert saved[-1] == result
    t = result["throughput"]
    assert t["paged"]["generated_tokens"] == t["contiguous"]["generated_tokens"] > 0
    assert np.isfinite(t["tokens_per_cpu_s_ratio"])
    path = tmp_path / "bench.json"
    write_json(str(path), saved[0])  # what --json writes after the paged half
    assert json.loads(path.read_text())["throughput"]["paged"]["requests"] == 3


def test_bench_engine_refuses_bad_options_in_one_line(smollm, capsys):
    """Bad options: each is one line on stderr and exit status 2, before any
    engine runs (the pool too large for memory after the model's cached load, seconds)."""
    from pagedkv.cli import main

    for argv in (
        ["--seed", "-1"],
        ["--requests", str(2**40)],
        ["--num-blocks", str(2**24)],  # 11,520 GiB of K/V for this model
        ["--num-blocks", str(2**24 + 1)],
        ["--block-size", str(2**40)],
        ["--max-model-len", "100000"],  # the contiguous engine could admit nothing
        ["--max-prompt", "300"],  # no room for an output in max_model_len 256
        ["--block-size", "1", "--sections", "n4"],
    ):
        assert main(["bench-engine", *argv]) == 2, argv
        err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert len(err) == 1 and err[0].startswith("pagedkv bench-engine: error:"), (argv, err)
