"""The NumPy paged-prefill reference: bit-identical to contiguous causal attention, row by row.

Every query row of a prefill (at position p of its sequence) must equal ``contiguous_attention``
of that query over the sequence's keys and values ``0..p`` with ``np.array_equal``, for both table
layouts and every mix of cached and new lengths (0 cached = plain prefill, 1 new = decode).
Against textbook float64 attention the tolerance is stated per dtype (fp32: 1e-5).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedkv.attention import contiguous_attention, paged_attention, paged_prefill_attention

from .conftest import as_float, to_kind
from .prefill_problems import make_prefill_problem


def expected_rows(p, causal=True, scale=None):
    """Each query row through contiguous_attention over its visible keys (the dense reference)."""
    rows = []
    for b, n in enumerate(p.q_lens):
        seq_len = int(p.seq_lens[b])
        q0 = int(p.query_start_loc[b])
        for j in range(n):
            visible = seq_len - n + j + 1 if causal else seq_len
            rows.append(
                contiguous_attention(
                    p.q[q0 + j], p.paged.keys[b][:visible], p.paged.values[b][:visible], scale=scale
                )
            )
    return rows


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(["float32", "float64", "float16", "bfloat16"]),
    block_size=st.integers(1, 32),
    head_dim=st.sampled_from([64, 128]),
    group=st.sampled_from([1, 3, 4, 8]),
    num_kv_heads=st.integers(1, 2),
    lens=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 12)), min_size=1, max_size=3),
    layout=st.sampled_from(["padded", "csr"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_prefill_is_bit_identical_to_contiguous_causal(
    kind, block_size, head_dim, group, num_kv_heads, lens, layout, seed
):
    cached, new = [c for c, _ in lens], [n for _, n in lens]
    p = make_prefill_problem(
        np.random.default_rng(seed), kind, cached, new, num_kv_heads, group, head_dim, block_size
    )
    out = paged_prefill_attention(*p.args(layout))
    assert out.shape == p.q.shape and out.dtype == p.q.dtype
    for r, expected in enumerate(expected_rows(p)):
        assert np.array_equal(out[r], expected), f"query row {r} differs"


@pytest.mark.parametrize("layout", ["padded", "csr"])
def test_mixed_batch_every_kind_of_row(layout):
    # plain prefill, prefix-hit suffix, chunk of a chunked prefill, decode, idle row, empty row
    cached = [0, 32, 17, 40, 9, 0]
    new = [13, 5, 16, 1, 0, 0]
    p = make_prefill_problem(np.random.default_rng(3), "float32", cached, new, 2, 4, 64, 16)
    out = paged_prefill_attention(*p.args(layout))
    for r, expected in enumerate(expected_rows(p)):
        assert np.array_equal(out[r], expected), f"query row {r} differs"


def test_decode_rows_equal_paged_attention():
    p = make_prefill_problem(np.random.default_rng(4), "float32", [7, 30, 0], [1, 1, 1], 2, 3, 128, 8)
    out = paged_prefill_attention(*p.args())
    decode = paged_attention(p.q, p.paged.k_cache, p.paged.v_cache, p.paged.block_tables, p.seq_lens)
    assert np.array_equal(out, decode)


@pytest.mark.parametrize("layout", ["padded", "csr"])
def test_non_causal_attends_to_every_key(layout):
    p = make_prefill_problem(np.random.default_rng(5), "float64", [10, 0], [6, 9], 1, 4, 64, 4)
    out = paged_prefill_attention(*p.args(layout), causal=False, scale=0.3)
    for r, expected in enumerate(expected_rows(p, causal=False, scale=0.3)):
        assert np.array_equal(out[r], expected)


def textbook_prefill(q, k, v, q_len, scale, causal=True):
    """float64 masked softmax attention of the last q_len positions, explicit GQA mapping."""
    seq_len = k.shape[0]
    num_q_heads = q.shape[1]
    group = num_q_heads // k.shape[1]
    out = np.empty_like(q)
    for j in range(q_len):
        pos = seq_len - q_len + j
        visible = pos + 1 if causal else seq_len
        for h in range(num_q_heads):
            s = k[:visible, h // group] @ q[j, h] * scale
            w = np.exp(s - s.max())
            out[j, h] = (w / w.sum()) @ v[:visible, h // group]
    return out


@pytest.mark.parametrize("kind,tol", [("float32", 1e-5), ("float16", 2e-3), ("bfloat16", 1.6e-2)])
def test_matches_textbook_attention_within_tolerance(kind, tol):
    p = make_prefill_problem(np.random.default_rng(6), kind, [20, 0], [11, 7], 2, 4, 128, 16)
    out = paged_prefill_attention(*p.args())
    for b, n in enumerate(p.q_lens):
        q0 = int(p.query_start_loc[b])
        expected = textbook_prefill(
            as_float(p.q[q0 : q0 + n], kind),
            as_float(p.paged.keys[b], kind),
            as_float(p.paged.values[b], kind),
            n,
            128**-0.5,
        )
        np.testing.assert_allclose(as_float(out[q0 : q0 + n], kind), expected, rtol=tol, atol=tol)


def test_masked_out_values_cannot_leak_nan():
    # A future token whose value is inf must not reach an earlier query through 0 * inf.
    p = make_prefill_problem(np.random.default_rng(8), "float32", [0], [6], 1, 1, 64, 4)
    last = p.paged.block_tables[0, 1]
    p.paged.v_cache[last, 1] = np.inf  # position 5, the last query's own token
    out = paged_prefill_attention(*p.args())
    assert np.isfinite(out[:5]).all()


def test_long_prompt_is_chunked_and_still_exact(monkeypatch):
    from pagedkv.attention import prefill_reference

    p = make_prefill_problem(np.random.default_rng(9), "float32", [3], [40], 1, 2, 64, 8)
    whole = paged_prefill_attention(*p.args())
    monkeypatch.setattr(prefill_reference, "MAX_SCORE_ELEMENTS", 2 * 43 * 3)  # 3 query rows per chunk
    assert np.array_equal(paged_prefill_attention(*p.args()), whole)


def test_chunked_prefill_equals_one_shot():
    # The same prompt attended in 3 chunks (each chunk: cached = earlier chunks) equals one shot.
    rng = np.random.default_rng(10)
    p = make_prefill_problem(rng, "float32", [0], [30], 2, 2, 64, 8)
    whole = paged_prefill_attention(*p.args())
    cuts = [0, 11, 12, 30]
    for c0, c1 in zip(cuts, cuts[1:], strict=False):
        out = paged_prefill_attention(
            p.q[c0:c1],
            p.paged.k_cache,
            p.paged.v_cache,
            p.paged.block_tables,
            np.array([c1], np.int32),
            np.array([0, c1 - c0], np.int32),
        )
        assert np.array_equal(out, whole[c0:c1])


def test_empty_batch_and_no_queries():
    p = make_prefill_problem(np.random.default_rng(11), "float16", [5], [0], 1, 1, 64, 4)
    out = paged_prefill_attention(*p.args())
    assert out.shape == (0, 1, 64) and out.dtype == np.float16
    q = to_kind(np.zeros((0, 2, 64)), "float32")
    cache = np.zeros((1, 4, 1, 64), np.float32)
    empty = paged_prefill_attention(
        q, cache, cache, np.zeros((0, 1), np.int32), np.zeros(0, np.int32), np.zeros(1, np.int32)
    )
    assert empty.shape == (0, 2, 64)
