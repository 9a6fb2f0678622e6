"""``pagedkv viz`` through its argparse hook: writes the page, serves it, rejects bad input."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from pagedkv.errors import InvalidArgumentError
from pagedkv.viz.cli_hook import add_viz_parser, run_viz
from pagedkv.viz.workload_source import trace_window


def parse(argv):
    parser = argparse.ArgumentParser(prog="pagedkv")
    add_viz_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


SMALL = ["--num-requests", "20", "--num-slots", "256", "--max-model-len", "64", "--max-steps", "30",
         "--block-sizes", "4,16", "--seeds", "0,1"]


def test_viz_writes_a_page(tmp_path, capsys):
    out = tmp_path / "v.html"
    args = parse(["viz", *SMALL, "--allocators", "paged,contiguous-pow2", "--out", str(out)])
    assert args.command == "viz"
    assert run_viz(args) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "8 runs" in printed
    text = out.read_text(encoding="utf-8")
    data = json.loads(re.search(r'<script type="application/json" id="viz-data">(.*?)</script>', text, re.S)
                      .group(1))
    assert sorted((r["allocator"], r["block_size"], r["seed"]) for r in data["runs"]) == sorted(
        (a, b, s) for a in ("paged", "contiguous-pow2") for b in (4, 16) for s in (0, 1))
    assert data["num_slots"] == 256 and data["max_model_len"] == 64


def test_viz_serve_prints_url_and_stops(tmp_path, capsys):
    out = tmp_path / "v.html"
    args = parse(["viz", *SMALL, "--allocators", "paged", "--seeds", "0", "--out", str(out),
                  "--serve", "--serve-seconds", "0.2"])
    assert run_viz(args) == 0
    assert re.search(r"at http://127\.0\.0\.1:\d+/", capsys.readouterr().out)


@pytest.mark.parametrize("flag,value,message", [
    ("--block-sizes", "4,x", "comma-separated integers"),
    ("--block-sizes", "512", "exceed the pool"),
    ("--allocators", "paged,nope", "expected some of"),
    ("--arrival", "poisson:-3", "poisson:RATE"),
    ("--arrival", "sometimes", "poisson:RATE"),
    ("--seeds", "-1", "seeds must be integers >= 0"),
    ("--workload", "no-such-workload", "unknown workload"),
])
def test_bad_arguments_are_clear_errors(tmp_path, flag, value, message):
    args = parse(["viz", *SMALL, flag, value, "--out", str(tmp_path / "v.html")])
    with pytest.raises(InvalidArgumentError, match=message):
        run_viz(args)
    assert not (tmp_path / "v.html").exists()


def test_trace_window_by_seed():
    from pagedkv.sim.engine import Workload
    import numpy as np

    trace = Workload(name="t", prompt_tokens=np.array([10, 500, 20, 30, 40, 50], dtype=np.int64),
                     output_tokens=np.array([5, 5, 5, 5, 5, 5], dtype=np.int64),
                     arrival_s=np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]))
    first, dropped = trace_window(trace, seed=0, num_requests=3, max_model_len=100)
    assert first.prompt_tokens.tolist() == [10, 20] and dropped == 1
    assert first.arrival_s.tolist() == [0.0, 2.0]
    other, _ = trace_window(trace, seed=5, num_requests=3, max_model_len=100)
    again, _ = trace_window(trace, seed=5, num_requests=3, max_model_len=100)
    assert other.prompt_tokens.tolist() == again.prompt_tokens.tolist()
    with pytest.raises(InvalidArgumentError, match="fits"):
        trace_window(trace, seed=0, num_requests=2, max_model_len=12)
