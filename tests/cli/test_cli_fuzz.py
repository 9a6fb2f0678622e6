"""Fuzzing the command line's numeric flags and the trace parser (bounded Hypothesis budgets).

Whatever the text: a flag's value is accepted within its bounds or refused with a usage error
(exit 2); a run ends with status 0 or 2 and never raises; a trace file gives a valid workload or
a `TraceError` naming the file, in a message of bounded length. ``PAGEDKV_FUZZ_EXAMPLES`` raises
the budgets for a longer run on demand.
"""

from __future__ import annotations

import contextlib
import io
import math
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pagedkv import cli
from pagedkv.commands.args import MAX_COUNT, MAX_NUM_REQUESTS
from pagedkv.sim import traces

SCALE = int(os.environ.get("PAGEDKV_FUZZ_EXAMPLES", "1"))

# (command, flag, lowest accepted, highest accepted); None: a float flag (finite, > 0 or >= 0).
NUMERIC_FLAGS = [
    ("simulate", "--num-requests", 1, MAX_NUM_REQUESTS),
    ("simulate", "--seed", 0, 2**64 - 1),
    ("simulate", "--block-size", 1, MAX_COUNT),
    ("simulate", "--num-slots", 1, MAX_COUNT),
    ("simulate", "--max-model-len", 1, MAX_COUNT),
    ("simulate", "--max-num-seqs", 1, MAX_COUNT),
    ("simulate", "--max-steps", 1, MAX_COUNT),
    ("simulate", "--num-host-slots", 0, MAX_COUNT),
    ("simulate", "--parallel-samples", 1, MAX_COUNT),
    ("simulate", "--step-time", None, None),
    ("simulate", "--prompt-mean", None, None),
    ("demo", "--num-requests", 1, MAX_NUM_REQUESTS),
    ("figure2", "--num-requests", 1, MAX_NUM_REQUESTS),
    ("sharing", "--num-requests", 1, MAX_NUM_REQUESTS),
    ("sharing", "--block-size", 1, MAX_COUNT),
    ("costmodel", "--num-layers", 1, MAX_COUNT),
    ("costmodel", "--cpu-max-context", 1, MAX_COUNT),
    ("costmodel", "--latency", None, None),
    ("viz", "--port", None, None),
]

TRICKY = [
    "1_000",
    "\u0661\u0662",
    "\uff11\uff12",
    " 7",
    "7 ",
    "0x10",
    "1e3",
    "+5",
    "-0",
    "",
    "nan",
    "inf",
    "-inf",
    "1" * 400,
    "9" * 30,
]
VALUE_TEXT = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(max_size=12),
    st.sampled_from(TRICKY),
)


@pytest.fixture(scope="module")
def parser():
    return cli.build_parser()


def _parse(parser, argv):
    """(namespace, None) or (None, exit status) with argparse's message swallowed."""
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            return parser.parse_args(argv), None
        except SystemExit as exit_:
            return None, exit_.code


@settings(max_examples=300 * SCALE, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flag=st.sampled_from(NUMERIC_FLAGS), text=VALUE_TEXT)
def test_numeric_flags_accept_in_bounds_or_refuse(parser, flag, text):
    command, option, low, high = flag
    if "\x00" in text:  # no process argument can hold a NUL
        return
    args, status = _parse(parser, [command, f"{option}={text}"])
    if args is None:
        assert status == 2
        return
    value = getattr(args, option.lstrip("-").replace("-", "_"))
    if option == "--port":
        assert isinstance(value, int)
    elif low is None:
        assert isinstance(value, float) and math.isfinite(value) and value >= 0
    else:
        assert isinstance(value, int) and low <= value <= high
        assert text.strip().lstrip("+-").isascii() and text.strip().lstrip("+-").isdigit()


EDGE_COUNTS = st.sampled_from([1, 2, 3, 15, 16, 17, 255, 4096, 2**31 - 1, 2**31, 2**40])


@settings(max_examples=25 * SCALE, deadline=None)
@given(
    allocator=st.sampled_from(["paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle"]),
    num_slots=EDGE_COUNTS,
    block_size=EDGE_COUNTS,
    max_model_len=st.one_of(st.none(), EDGE_COUNTS),
    max_num_seqs=EDGE_COUNTS,
    max_steps=st.one_of(st.none(), EDGE_COUNTS),
    preemption=st.sampled_from(["recompute", "swap"]),
    num_host_slots=st.one_of(st.none(), st.sampled_from([0, 1, 16, 2**31, 2**40])),
    arrival=st.sampled_from(["saturated", "trace", "poisson:0.001", "poisson:1e9"]),
    num_requests=st.integers(1, 12),
    seed=st.sampled_from([0, 1, 2**64 - 1]),
)
def test_simulate_ends_with_0_or_2_whatever_the_numbers(
    allocator,
    num_slots,
    block_size,
    max_model_len,
    max_num_seqs,
    max_steps,
    preemption,
    num_host_slots,
    arrival,
    num_requests,
    seed,
):
    argv = ["simulate", "--no-progress", "--allocator", allocator, "--num-slots", num_slots]
    argv += ["--block-size", block_size, "--max-num-seqs", max_num_seqs, "--preemption", preemption]
    argv += ["--arrival", arrival, "--num-requests", num_requests, "--seed", seed]
    for option, value in (("--max-model-len", max_model_len), ("--max-steps", max_steps)):
        if value is not None:
            argv += [option, value]
    if num_host_slots is not None:
        argv += ["--num-host-slots", num_host_slots]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main([str(arg) for arg in argv])
    assert status in (0, 2), err.getvalue()
    if status == 2:
        assert "error:" in err.getvalue() and len(err.getvalue()) < 2_000


# ---------------------------------------------------------------- the trace parser

FIELD = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["2023-11-16 18:15:46.6805900", "2023-11-16T00:00:00", "2023-02-30 10:00:00", "1e300"]),
    st.sampled_from(TRICKY),
    st.text(max_size=10),
)
ROW = st.one_of(
    st.lists(FIELD, min_size=1, max_size=4).map(",".join),
    st.tuples(FIELD, st.integers(1, 5000), st.integers(1, 500)).map(lambda r: f"{r[0]},{r[1]},{r[2]}"),
)


@settings(max_examples=200 * SCALE, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    header=st.sampled_from(
        ["TIMESTAMP,ContextTokens,GeneratedTokens", "\ufeffTIMESTAMP,ContextTokens,GeneratedTokens"]
    ),
    rows=st.lists(ROW, max_size=6),
    tail=st.binary(max_size=8),
)
def test_trace_parser_gives_a_workload_or_a_trace_error(tmp_path_factory, header, rows, tail):
    path = tmp_path_factory.mktemp("fuzz") / "trace.csv"
    path.write_bytes(("\n".join([header, *rows]) + "\n").encode("utf-8", "surrogatepass") + tail)
    try:
        workload = traces.read_azure_csv(path)
    except traces.TraceError as error:
        message = str(error)
        assert str(path) in message and len(message) < 1_000
        return
    assert workload.num_requests >= 1
    assert (workload.prompt_tokens >= 1).all() and (workload.output_tokens >= 1).all()
    assert np.isfinite(workload.arrival_s).all() and workload.arrival_s[0] == 0.0
    assert (np.diff(workload.arrival_s) >= 0).all()
    assert workload.arrival_s[-1] <= traces.MAX_TRACE_SPAN_S
