"""Sliding-window attention in the NumPy reference (``window=``): bit-identical to
``contiguous_attention`` over the window-cropped keys, and never reading a released block.

A query at position p sees keys [p - window + 1, p] (inclusive, as Gemma / Hugging Face define
it). Every test releases what a sliding-window KV group would: each block whose tokens all lie
before the first key any query of the call sees is filled with NaN and its table entry set to -1,
so a stray read shows up as NaN or as a refused -1 entry.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedkv.attention import contiguous_attention, paged_attention, paged_prefill_attention
from pagedkv.errors import InvalidArgumentError

from .conftest import nan_fill_value
from .prefill_problems import PrefillProblem, make_prefill_problem

KINDS = ["float32", "float64", "float16", "bfloat16"]


def release_out_of_window(p: PrefillProblem, window: int) -> None:
    """Poison and unmap (-1) every block wholly before the window of each sequence's first query."""
    bs = p.paged.k_cache.shape[1]
    fill = nan_fill_value(p.paged.kind)
    for b, n in enumerate(p.q_lens):
        seq_len = int(p.seq_lens[b])
        first_key = max(0, seq_len - n - window + 1) if n else seq_len
        for i in range(first_key // bs):
            block = p.paged.block_tables[b, i]
            p.paged.k_cache[block] = fill
            p.paged.v_cache[block] = fill
            p.paged.block_tables[b, i] = -1


def windowed_rows(p: PrefillProblem, window: int) -> list[np.ndarray]:
    rows = []
    for b, n in enumerate(p.q_lens):
        seq_len = int(p.seq_lens[b])
        q0 = int(p.query_start_loc[b])
        for j in range(n):
            pos = seq_len - n + j
            lo = max(0, pos - window + 1)
            rows.append(
                contiguous_attention(
                    p.q[q0 + j], p.paged.keys[b][lo : pos + 1], p.paged.values[b][lo : pos + 1]
                )
            )
    return rows


problems = st.fixed_dictionaries(
    {
        "kind": st.sampled_from(KINDS),
        "block_size": st.integers(1, 16),
        "head_dim": st.sampled_from([16, 64]),
        "group": st.sampled_from([1, 2, 4]),
        "num_kv_heads": st.integers(1, 2),
        "lens": st.lists(st.tuples(st.integers(0, 48), st.integers(0, 10)), min_size=1, max_size=3),
        "window": st.integers(1, 40),
        "seed": st.integers(0, 2**31 - 1),
    }
)


@settings(max_examples=60, deadline=None)
@given(case=problems, layout=st.sampled_from(["padded", "csr"]))
def test_windowed_prefill_is_bit_identical_to_contiguous_over_the_window(case, layout):
    cached, new = [c for c, _ in case["lens"]], [n for _, n in case["lens"]]
    p = make_prefill_problem(
        np.random.default_rng(case["seed"]),
        case["kind"],
        cached,
        new,
        case["num_kv_heads"],
        case["group"],
        case["head_dim"],
        case["block_size"],
    )
    release_out_of_window(p, case["window"])
    out = paged_prefill_attention(*p.args(layout), window=case["window"])
    assert out.shape == p.q.shape and out.dtype == p.q.dtype
    for r, expected in enumerate(windowed_rows(p, case["window"])):
        assert np.array_equal(out[r], expected), f"query row {r} differs"


@settings(max_examples=60, deadline=None)
@given(case=problems)
def test_windowed_decode_is_bit_identical_to_contiguous_over_the_window(case):
    seq_lens = [max(1, c + n) for c, n in case["lens"]]
    p = make_prefill_problem(
        np.random.default_rng(case["seed"]),
        case["kind"],
        [n - 1 for n in seq_lens],
        [1] * len(seq_lens),
        case["num_kv_heads"],
        case["group"],
        case["head_dim"],
        case["block_size"],
    )
    release_out_of_window(p, case["window"])
    out = paged_attention(
        p.q, p.paged.k_cache, p.paged.v_cache, p.paged.block_tables, p.seq_lens, window=case["window"]
    )
    for b, expected in enumerate(windowed_rows(p, case["window"])):
        assert np.array_equal(out[b], expected), f"sequence {b} differs"
    # A decode is a one-query prefill: both entry points agree.
    prefill = paged_prefill_attention(*p.args(), window=case["window"])
    assert np.array_equal(out, prefill)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), lens=st.lists(st.integers(2, 30), min_size=1, max_size=3))
def test_a_window_covering_the_context_changes_no_bit(seed, lens):
    p = make_prefill_problem(np.random.default_rng(seed), "float32", [0] * len(lens), lens, 1, 2, 16, 4)
    full = paged_prefill_attention(*p.args())
    assert np.array_equal(paged_prefill_attention(*p.args(), window=max(lens)), full)
    assert not np.array_equal(paged_prefill_attention(*p.args(), window=1), full)


def test_window_one_is_the_query_position_value():
    """window=1: each query sees only its own key, so the output is that token's value."""
    p = make_prefill_problem(np.random.default_rng(0), "float64", [5], [4], 1, 2, 16, 4)
    out = paged_prefill_attention(*p.args(), window=1)
    for j in range(4):
        assert np.array_equal(out[j], np.repeat(p.paged.values[0][5 + j], 2, axis=0))


def test_a_minus_one_entry_inside_the_window_is_refused():
    p = make_prefill_problem(np.random.default_rng(1), "float32", [12], [2], 1, 1, 16, 4)
    release_out_of_window(p, 8)  # keys 5.. visible: block 1 (tokens 4..7) is read
    assert p.paged.block_tables[0, 0] == -1
    p.paged.block_tables[0, 1] = -1
    with pytest.raises(InvalidArgumentError, match="block"):
        paged_prefill_attention(*p.args(), window=8)
    with pytest.raises(InvalidArgumentError, match="block"):
        paged_attention(p.q[1:], p.paged.k_cache, p.paged.v_cache, p.paged.block_tables, p.seq_lens, window=8)
    # Without a window every entry is read, the released first block included.
    p2 = make_prefill_problem(np.random.default_rng(1), "float32", [12], [2], 1, 1, 16, 4)
    release_out_of_window(p2, 8)
    with pytest.raises(InvalidArgumentError, match="block"):
        paged_prefill_attention(*p2.args())


@pytest.mark.parametrize("window", [0, -3, 2.0, True, "8"])
def test_bad_windows_are_refused(window):
    p = make_prefill_problem(np.random.default_rng(2), "float32", [3], [2], 1, 1, 16, 4)
    with pytest.raises(InvalidArgumentError, match="window"):
        paged_prefill_attention(*p.args(), window=window)
    with pytest.raises(InvalidArgumentError, match="window"):
        paged_attention(
            p.q[1:], p.paged.k_cache, p.paged.v_cache, p.paged.block_tables, p.seq_lens, window=window
        )


def test_a_window_needs_causal_attention():
    p = make_prefill_problem(np.random.default_rng(3), "float32", [3], [2], 1, 1, 16, 4)
    with pytest.raises(InvalidArgumentError, match="causal"):
        paged_prefill_attention(*p.args(), causal=False, window=4)
