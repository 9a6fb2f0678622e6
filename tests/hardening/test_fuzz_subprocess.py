"""Arbitrary arrays at every batch argument of the manager, in a child interpreter.

Hypothesis draws lists of specs (call, dtype, byte order, layout, values); ``fuzz_child.py``
builds the arrays and checks each call against the same call with a plain list (see its
docstring). An abort or segfault in the child fails the test with the case that caused it.
The example budget is bounded for CI; ``PAGEDKV_FUZZ_EXAMPLES=5000`` runs longer on demand.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
from hypothesis import Phase, given, settings

CHILD = Path(__file__).with_name("fuzz_child.py")
EXAMPLES = int(os.environ.get("PAGEDKV_FUZZ_EXAMPLES", "6"))

DTYPES = [
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float32",
    "float64",
    "bool",
]
LAYOUTS = [
    "contiguous",
    "negative_stride",
    "strided",
    "readonly",
    "misaligned",
    "subclass",
    "broadcast",
    "broadcast_huge",
    "masked",
    "matrix",
    "two_d",
    "zero_d",
]
CALLS = [
    "add_sequence",
    "append_tokens",
    "batch_tokens",
    "batch_ids",
    "free_batch",
    "batch_block_tables",
    "slot_mapping",
    "swap_out",
    "swap_in",
    "copy_blocks",
    "swap_blocks",
    "write_kv",
    "paged_attention",
]
VALUE = st.one_of(
    st.integers(0, 5), st.integers(-3, 300), st.sampled_from([2**31 - 1, 2**32, 2**63 - 1, -(2**63)])
)
SPEC = st.fixed_dictionaries(
    {
        "call": st.sampled_from(CALLS),
        "dtype": st.sampled_from(DTYPES),
        "order": st.sampled_from(["=", "<", ">"]),
        "layout": st.sampled_from(LAYOUTS),
        "values": st.lists(VALUE, min_size=0, max_size=6),
    }
)


def run_child(specs: list[dict[str, Any]]) -> None:
    proc = subprocess.run(
        [sys.executable, str(CHILD)], input=json.dumps(specs), capture_output=True, text=True, timeout=300
    )
    lines = proc.stdout.splitlines()
    last = next((line for line in reversed(lines) if line.startswith("START")), None)
    assert proc.returncode == 0, (
        f"child died with status {proc.returncode} in case {last} "
        f"({specs[int(last.split()[1])] if last else None}): {proc.stderr[-2000:]}"
    )
    bad = [line for line in lines if line.startswith("BAD")]
    assert not bad, "\n".join(bad)
    assert lines and lines[-1] == "DONE"


# No shrinking: each example is a child process, and the BAD lines already name the spec.
@settings(max_examples=EXAMPLES, deadline=None, database=None, phases=[Phase.generate])
@given(st.lists(SPEC, min_size=40, max_size=80))
def test_arrays_behave_like_lists_or_are_refused(specs: list[dict[str, Any]]) -> None:
    run_child(specs)


def test_every_layout_and_call_once() -> None:
    """A fixed sweep, so every layout meets every call in CI whatever Hypothesis draws."""
    specs = [
        {"call": call, "dtype": dtype, "order": order, "layout": layout, "values": [0, 1, 3]}
        for call in CALLS
        for layout in LAYOUTS
        for dtype, order in (("int64", "="), ("uint32", ">"), ("int8", "="), ("float64", "="))
    ]
    run_child(specs)
