"""``pagedkv viz`` end to end through ``pagedkv.cli.main``: page, JSON, serving, bad input."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from pagedkv.cli import main
from pagedkv.errors import InvalidArgumentError
from pagedkv.viz.page import read_page_data
from pagedkv.viz.workload_source import trace_window

SMALL = [
    "--num-requests",
    "20",
    "--num-slots",
    "256",
    "--max-model-len",
    "64",
    "--max-steps",
    "30",
    "--block-sizes",
    "4,16",
    "--no-progress",
]


def test_viz_writes_page_and_json(tmp_path, capsys):
    out, summary = tmp_path / "v.html", tmp_path / "v.json"
    status = main(
        [
            "viz",
            *SMALL,
            "--allocators",
            "paged,contiguous-pow2",
            "--seed",
            "5",
            "--block-size",
            "4",
            "--allocator",
            "contiguous-pow2",
            "--out",
            str(out),
            "--json",
            str(summary),
        ]
    )
    assert status == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "12 runs" in printed
    data = read_page_data(out.read_text(encoding="utf-8"))
    assert sorted((r["allocator"], r["block_size"], r["seed"]) for r in data["runs"]) == sorted(
        (a, b, s) for a in ("paged", "contiguous-pow2") for b in (4, 16) for s in (5, 6, 7)
    )
    assert data["num_slots"] == 256 and data["max_model_len"] == 64
    assert data["initial"] == {"allocator": "contiguous-pow2", "block_size": 4, "seed": 5}
    assert all(1 <= r["n"] <= 30 for r in data["runs"])
    written = json.loads(summary.read_text(encoding="utf-8"))
    assert len(written["runs"]) == 12
    assert {"token_states", "preemptions", "finished_requests"} <= set(written["runs"][0])


def test_viz_serve_prints_url_and_stops(tmp_path, capsys):
    status = main(
        [
            "viz",
            *SMALL,
            "--allocators",
            "paged",
            "--seeds",
            "0",
            "--out",
            str(tmp_path / "v.html"),
            "--serve",
            "--serve-seconds",
            "0.2",
        ]
    )
    assert status == 0
    assert re.search(r"at http://127\.0\.0\.1:\d+/", capsys.readouterr().out)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--block-sizes", "4,x"], "comma-separated integers"),
        (["--block-sizes", "512"], "exceed the pool"),
        (["--allocators", "paged,nope"], "expected some of"),
        (["--seeds", "-1"], "seeds must be integers >= 0"),
        (["--workload", "no-such-workload"], "no-such-workload"),
        (["--plot", "x.svg"], "PNG"),
    ],
)
def test_bad_arguments_are_clear_errors(tmp_path, capsys, flags, message):
    out = tmp_path / "v.html"
    assert main(["viz", *SMALL, *flags, "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_trace_window_by_seed():
    from pagedkv.sim.engine import Workload

    trace = Workload(
        name="t",
        prompt_tokens=np.array([10, 500, 20, 30, 40, 50], dtype=np.int64),
        output_tokens=np.array([5, 5, 5, 5, 5, 5], dtype=np.int64),
        arrival_s=np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]),
        group_size=np.array([1, 2, 3, 4, 5, 6], dtype=np.int64),
        group_kind="parallel",
    )
    first, dropped = trace_window(trace, seed=0, num_requests=3, max_model_len=100)
    assert first.prompt_tokens.tolist() == [10, 20] and dropped == 1
    assert first.arrival_s.tolist() == [0.0, 2.0]
    assert first.group_size.tolist() == [1, 3]
    other, _ = trace_window(trace, seed=5, num_requests=3, max_model_len=100)
    again, _ = trace_window(trace, seed=5, num_requests=3, max_model_len=100)
    assert other.prompt_tokens.tolist() == again.prompt_tokens.tolist()
    with pytest.raises(InvalidArgumentError, match="fits"):
        trace_window(trace, seed=0, num_requests=2, max_model_len=12)


def test_viz_on_a_real_trace(tmp_path):
    from pagedkv.sim import traces

    path = traces.known_trace_path("azure-code")  # the bundled copy when no shared/traces
    out = tmp_path / "t.html"
    assert (
        main(
            [
                "viz",
                "--workload",
                str(path),
                "--num-requests",
                "40",
                "--num-slots",
                "8192",
                "--max-model-len",
                "4096",
                "--max-steps",
                "20",
                "--block-sizes",
                "16",
                "--allocators",
                "paged,contiguous-max",
                "--seeds",
                "0,1",
                "--no-progress",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    data = read_page_data(out.read_text(encoding="utf-8"))
    assert {r["seed"] for r in data["runs"]} == {0, 1}
    assert "requests 0..39" in data["workload"]["by_seed"]["0"]


def test_default_page_stays_small(tmp_path, capsys):
    """The default grid (4 allocators x 6 block sizes, 300 steps, 2048 slots), one seed of three:
    the page for all three seeds stays within a few MB."""
    out = tmp_path / "default.html"
    assert main(["viz", "--seeds", "0", "--no-progress", "--out", str(out)]) == 0
    size_bytes = out.stat().st_size
    assert size_bytes * 3 < 4 * 1024 * 1024, f"{size_bytes} bytes for one seed"
    data = read_page_data(out.read_text(encoding="utf-8"))
    assert len(data["runs"]) == 24 and all(r["n"] == 300 for r in data["runs"])
    print(f"default page, one seed: {size_bytes / 1024:.0f} KiB")
