"""The NumPy reference: paged == contiguous bit for bit, and the math is attention."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedkv.attention import contiguous_attention, copy_blocks, paged_attention, swap_blocks, write_kv

from .conftest import as_float, make_problem, to_kind


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(["float32", "float64"]),
    block_size=st.integers(1, 32),
    head_dim=st.sampled_from([64, 128]),
    group=st.sampled_from([1, 3, 4, 8]),
    num_kv_heads=st.integers(1, 2),
    seq_lens=st.lists(st.integers(1, 70), min_size=1, max_size=3),
    seed=st.integers(0, 2**31 - 1),
)
def test_paged_is_bit_identical_to_contiguous(
    kind, block_size, head_dim, group, num_kv_heads, seq_lens, seed
):
    rng = np.random.default_rng(seed)
    p = make_problem(rng, kind, seq_lens, num_kv_heads, group, head_dim, block_size)
    out = paged_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens)
    for b in range(len(seq_lens)):
        expected = contiguous_attention(p.q[b], p.keys[b], p.values[b])
        assert np.array_equal(out[b], expected), f"sequence {b} differs"


@pytest.mark.parametrize("odd_len", [1, 3, 17, 31, 33, 127])
@pytest.mark.parametrize("kind", ["float32", "float64"])
def test_bit_identity_odd_lengths_block_size_32(odd_len, kind):
    rng = np.random.default_rng(odd_len)
    p = make_problem(rng, kind, [odd_len, odd_len + 2], 2, 4, 128, 32)
    out = paged_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens)
    for b in range(2):
        assert np.array_equal(out[b], contiguous_attention(p.q[b], p.keys[b], p.values[b]))


def naive_attention(q, k, v, scale):
    """Textbook float64 softmax attention with explicit GQA head mapping."""
    num_q_heads = q.shape[0]
    group = num_q_heads // k.shape[1]
    out = np.empty_like(q)
    for h in range(num_q_heads):
        kh, vh = k[:, h // group], v[:, h // group]
        s = kh @ q[h] * scale
        w = np.exp(s - s.max())
        out[h] = (w / w.sum()) @ vh
    return out


@pytest.mark.parametrize("group", [1, 3, 8])
def test_contiguous_matches_textbook_attention(group):
    rng = np.random.default_rng(group)
    q = rng.standard_normal((2 * group, 64))
    k = rng.standard_normal((45, 2, 64))
    v = rng.standard_normal((45, 2, 64))
    np.testing.assert_allclose(
        contiguous_attention(q, k, v, scale=0.3), naive_attention(q, k, v, 0.3), rtol=1e-12, atol=1e-12
    )
    np.testing.assert_allclose(
        contiguous_attention(q, k, v), naive_attention(q, k, v, 1 / 8), rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize("kind,tol", [("float16", 2e-3), ("bfloat16", 1.6e-2), ("float32", 1e-6)])
def test_low_precision_kinds_accumulate_in_fp32(kind, tol):
    rng = np.random.default_rng(7)
    q = to_kind(rng.standard_normal((4, 128)), kind)
    k = to_kind(rng.standard_normal((50, 1, 128)), kind)
    v = to_kind(rng.standard_normal((50, 1, 128)), kind)
    out = contiguous_attention(q, k, v)
    assert out.dtype == q.dtype
    expected = naive_attention(as_float(q, kind), as_float(k, kind), as_float(v, kind), 128**-0.5)
    np.testing.assert_allclose(as_float(out, kind), expected, rtol=tol, atol=tol)


def test_empty_history_gives_zeros():
    q = np.ones((2, 64), np.float32)
    k = np.zeros((0, 1, 64), np.float32)
    assert np.array_equal(contiguous_attention(q, k, k), np.zeros((2, 64), np.float32))
    cache = np.full((2, 8, 1, 64), np.nan, np.float32)
    out = paged_attention(q[None], cache, cache, np.full((1, 3), -1, np.int32), np.zeros(1, np.int32))
    assert np.array_equal(out, np.zeros((1, 2, 64), np.float32))


def test_write_kv_scatters_and_skips_padding():
    rng = np.random.default_rng(1)
    k_cache = np.zeros((4, 8, 2, 64), np.float32)
    v_cache = np.zeros_like(k_cache)
    k = rng.standard_normal((3, 2, 64)).astype(np.float32)
    v = rng.standard_normal((3, 2, 64)).astype(np.float32)
    write_kv(k, v, k_cache, v_cache, np.array([17, -1, 3], np.int64))
    assert np.array_equal(k_cache[2, 1], k[0]) and np.array_equal(v_cache[2, 1], v[0])
    assert np.array_equal(k_cache[0, 3], k[2]) and np.array_equal(v_cache[0, 3], v[2])
    assert np.count_nonzero(k_cache) == 2 * 2 * 64


def test_copy_blocks_runs_in_order_over_layers():
    caches = [np.arange(5 * 2 * 1 * 64, dtype=np.float32).reshape(5, 2, 1, 64) + 1000 * i for i in range(4)]
    before = [c.copy() for c in caches]
    copy_blocks(caches[:2], caches[2:], np.array([[0, 3], [3, 4]], np.int32))  # chain: 4 gets 0's content
    for c, b in zip(caches, before, strict=True):
        assert np.array_equal(c[3], b[0]) and np.array_equal(c[4], b[0])
        assert np.array_equal(c[:3], b[:3])


def test_swap_blocks_merges_adjacent_runs():
    src = np.arange(6 * 2 * 1 * 64, dtype=np.float32).reshape(6, 2, 1, 64)
    dst = np.zeros((8, 2, 1, 64), np.float32)
    mapping = np.array([[1, 4], [2, 5], [0, 0], [5, 7], [3, 6]], np.int32)
    copies = swap_blocks(src, dst, mapping)
    for s, d in mapping:
        assert np.array_equal(dst[d], src[s])
    assert copies == 3  # (0->0), (1,2,3 -> 4,5,6), (5->7)
