"""The fused elementwise ops (``_core.cpu_rms_norm``, ``cpu_add_rms_norm``, ``cpu_silu_mul``,
``cpu_rope_interleaved``) against NumPy, and the llama model that uses them.

Tolerances (against float64 references computed from the same fp32 inputs): the norm performs
NumPy's operations in NumPy's order except for the order of the fp32 sum of squares, so each
output is within ``4 * 2^-24 * (1 + |ref|)`` plus the sum's own rounding bound ``d * 2^-24``
relative; SiLU uses a polynomial exp within 2 ulp, so ``1e-6 * (1 + |ref|)``. Rope is bit-identical
to ``pagedkv.models.llama.rotary_interleaved``. A row's result never depends on its batch.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedkv import _core
from pagedkv.errors import InvalidArgumentError
from pagedkv.models.llama import rms_norm, rotary_interleaved

from cpu.dense_attention import DenseAttention
from cpu.smollm2_models import smollm2_and_fp32_twin

_EPS = 1e-5


def _rows(seed: int, t: int, d: int, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((t, d)) * scale).astype(np.float32)


def _norm64(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    ms = np.mean(x64 * x64, axis=-1, keepdims=True)
    return x64 / np.sqrt(ms + np.float64(np.float32(eps))) * weight.astype(np.float64)


def _norm_tolerance(d: int, ref: np.ndarray) -> np.ndarray:
    return (4 + d) * 2.0**-24 * (1 + np.abs(ref))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 40), st.integers(1, 700), st.integers(0, 2**32 - 1), st.sampled_from([1e-3, 1.0, 30.0]))
def test_rms_norm_and_add_rms_norm_match_float64(t: int, d: int, seed: int, scale: float) -> None:
    x, delta = _rows(seed, t, d, scale), _rows(seed + 1, t, d, scale)
    weight = _rows(seed + 2, 1, d)[0]
    got = _core.cpu_rms_norm(x, weight, _EPS)
    ref = _norm64(x, weight, _EPS)
    assert got.dtype == np.float32 and got.shape == (t, d)
    assert np.all(np.abs(got - ref) <= _norm_tolerance(d, ref))
    # The NumPy reference of the model, within the same bound.
    assert np.all(np.abs(got - rms_norm(x, weight, _EPS)) <= 2 * _norm_tolerance(d, ref))
    summed, normed = _core.cpu_add_rms_norm(x, delta, weight, _EPS)
    assert np.array_equal(summed, x + delta)
    assert np.array_equal(normed, _core.cpu_rms_norm(summed, weight, _EPS))
    for j in range(t):  # a row's bits do not depend on its batch
        assert np.array_equal(_core.cpu_rms_norm(x[j : j + 1], weight, _EPS)[0], got[j])


def test_rms_norm_rows_of_zeros_and_huge_values() -> None:
    weight = np.ones(8, np.float32)
    x = np.array([[0.0] * 8, [1e30] * 8, [np.inf] + [1.0] * 7, [np.nan] + [1.0] * 7], np.float32)
    got = _core.cpu_rms_norm(x, weight, _EPS)
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(got, rms_norm(x, weight, _EPS))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 40), st.integers(0, 700), st.integers(0, 2**32 - 1), st.sampled_from([0.1, 3.0, 20.0]))
def test_silu_mul_matches_float64(t: int, f: int, seed: int, scale: float) -> None:
    gate_up = _rows(seed, t, 2 * f, scale)
    got = _core.cpu_silu_mul(gate_up)
    g, u = gate_up[:, :f].astype(np.float64), gate_up[:, f:].astype(np.float64)
    with np.errstate(over="ignore"):
        ref = g / (1.0 + np.exp(-g)) * u
    assert got.dtype == np.float32 and got.shape == (t, f)
    assert np.all(np.abs(got - ref) <= 1e-6 * (1 + np.abs(ref)))
    for j in range(t):
        assert np.array_equal(_core.cpu_silu_mul(gate_up[j : j + 1])[0], got[j])


def test_silu_mul_extremes_propagate_as_numpy_does() -> None:
    gate = np.array(
        [90, -90, 88.7, -88.7, 104, -104, 1e30, -1e30, np.inf, -np.inf, np.nan, 0.0, -0.0], np.float32
    )
    for up in (np.ones_like(gate), np.full_like(gate, -2.5), np.full_like(gate, np.nan)):
        got = _core.cpu_silu_mul(np.concatenate([gate, up])[None, :])[0]
        with np.errstate(all="ignore"):
            ref = (gate / (1.0 + np.exp(-gate))) * up
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=0)  # nan where NumPy has nan
        assert np.array_equal(np.signbit(got), np.signbit(ref))


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 40),
    st.integers(1, 12),
    st.integers(1, 40).map(lambda p: 2 * p),
    st.integers(0, 2**32 - 1),
    st.data(),
)
def test_rope_is_bit_identical_to_numpy(t: int, heads: int, hd: int, seed: int, data: st.DataObject) -> None:
    x = _rows(seed, t, heads * hd, 4.0).reshape(t, heads, hd)
    angles = np.random.default_rng(seed + 1).uniform(-1e4, 1e4, (t, hd // 2))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    first = data.draw(st.integers(0, heads))
    count = data.draw(st.integers(0, heads - first))
    got = _core.cpu_rope_interleaved(x, cos, sin, first, count)
    assert got.dtype == np.float32 and got.shape == (t, count, hd) and got.flags.c_contiguous
    ref = rotary_interleaved(x[:, first : first + count], cos, sin)
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))
    assert np.array_equal(_core.cpu_rope_interleaved(x, cos, sin), rotary_interleaved(x, cos, sin))
    assert np.array_equal(
        _core.cpu_rope_interleaved(x, cos, sin, first), rotary_interleaved(x[:, first:], cos, sin)
    )


def test_large_batches_take_the_threaded_path_with_the_same_bits() -> None:
    t, d = 300, 577  # above the single-thread threshold (2^16 outputs)
    x, delta, weight = _rows(1, t, d), _rows(2, t, d), _rows(3, 1, d)[0]
    summed, normed = _core.cpu_add_rms_norm(x, delta, weight, _EPS)
    act = _core.cpu_silu_mul(np.concatenate([x, delta], axis=1))
    for j in (0, 1, 150, t - 1):
        s1, n1 = _core.cpu_add_rms_norm(x[j : j + 1], delta[j : j + 1], weight, _EPS)
        assert np.array_equal(s1[0], summed[j]) and np.array_equal(n1[0], normed[j])
        assert np.array_equal(
            _core.cpu_silu_mul(np.concatenate([x[j : j + 1], delta[j : j + 1]], axis=1))[0], act[j]
        )
    xr = _rows(4, t, 12 * 64).reshape(t, 12, 64)
    angles = np.arange(t * 32, dtype=np.float64).reshape(t, 32) * 0.01
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    assert np.array_equal(_core.cpu_rope_interleaved(xr, cos, sin), rotary_interleaved(xr, cos, sin))


_X = np.ones((2, 4), np.float32)
_W = np.ones(4, np.float32)
_Q = np.ones((2, 3, 4), np.float32)
_C = np.ones((2, 2), np.float32)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: _core.cpu_rms_norm(_X.astype(np.float64), _W, _EPS), "float32"),
        (lambda: _core.cpu_rms_norm(_X[0], _W, _EPS), "2-D"),
        (lambda: _core.cpu_rms_norm(_X, _W[None], _EPS), "1-D"),
        (lambda: _core.cpu_rms_norm(_X, _W[:3], _EPS), "weight must be"),
        (lambda: _core.cpu_rms_norm(np.ones((4, 2), np.float32).T, _W, _EPS), "C-contiguous"),
        (lambda: _core.cpu_rms_norm([[1.0]], np.ones(1, np.float32), _EPS), "float32"),
        (lambda: _core.cpu_add_rms_norm(_X, _X[:1], _W, _EPS), "delta must"),
        (lambda: _core.cpu_add_rms_norm(_X, _X.astype(np.float16), _W, _EPS), "float32"),
        (lambda: _core.cpu_add_rms_norm(_X, np.ones((4, 2), np.float32).T, _W, _EPS), "C-contiguous"),
        (lambda: _core.cpu_add_rms_norm(_X, _X, _W[:2], _EPS), "weight must be"),
        (lambda: _core.cpu_silu_mul(np.ones((2, 5), np.float32)), "even"),
        (lambda: _core.cpu_silu_mul(np.ones(4, np.float32)), "2-D"),
        (lambda: _core.cpu_silu_mul(np.ones((2, 4), np.int32)), "float32"),
        (lambda: _core.cpu_silu_mul(np.ones((4, 4), np.float32)[:, ::2]), "C-contiguous"),
        (lambda: _core.cpu_rope_interleaved(np.ones((2, 3, 5), np.float32), _C, _C), "even"),
        (lambda: _core.cpu_rope_interleaved(_Q, _C[:1], _C), "cos and sin"),
        (lambda: _core.cpu_rope_interleaved(_Q, _C, np.ones((2, 3), np.float32)), "cos and sin"),
        (lambda: _core.cpu_rope_interleaved(_Q[0], _C, _C), "3-D"),
        (lambda: _core.cpu_rope_interleaved(_Q, _C.astype(np.float64), _C), "float32"),
        (lambda: _core.cpu_rope_interleaved(_Q[:, ::2], _C, _C), "C-contiguous"),
        (lambda: _core.cpu_rope_interleaved(_Q, _C, _C, 4), "heads"),
        (lambda: _core.cpu_rope_interleaved(_Q, _C, _C, 1, 3), "heads"),
        (lambda: _core.cpu_rope_interleaved(_Q, _C, _C, 2**63, 2**63), "heads"),
    ],
)
def test_hostile_arguments_are_refused(call: object, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        call()  # type: ignore[operator]


def test_negative_sizes_are_refused() -> None:
    with pytest.raises(OverflowError):
        _core.cpu_rope_interleaved(_Q, _C, _C, -1)
    with pytest.raises(OverflowError):
        _core.cpu_rope_interleaved(_Q, _C, _C, 0, -1)


def test_smollm2_batched_decode_on_the_fused_ops_matches_fp32() -> None:
    """The quantized mode (fused ops) against the fp32 mode (the NumPy reference) on a batch of
    three sequences at different positions, with and without ``logit_rows``: logits within 1e-4
    of their range, the same greedy tokens (the tolerance of test_block_matmul's model test)."""
    from pagedkv.models.llama import LlamaModel

    model, ref = smollm2_and_fp32_twin()
    assert isinstance(model, LlamaModel) and model.weight_dtype == "quantized"
    prompts = [np.array([1, 504, 3458, 314]), np.array([260, 4371]), np.array([282, 4649, 30, 1, 504])]
    caches = [(DenseAttention(), DenseAttention()) for _ in prompts]
    last = []
    for p, (a, b) in zip(prompts, caches, strict=True):
        la, lb = model.forward(p, np.arange(len(p)), a), ref.forward(p, np.arange(len(p)), b)
        assert np.max(np.abs(la - lb)) <= 1e-4 * (lb.max() - lb.min())
        last.append(int(np.argmax(lb[-1])))
    # One decode step of all three at once, through a batch-aware attention.
    tokens = np.array(last)
    positions = np.array([len(p) for p in prompts])
    la = model.forward(tokens, positions, _Batched([a for a, _ in caches]), logit_rows=np.array([2, 0]))
    lb = ref.forward(tokens, positions, _Batched([b for _, b in caches]), logit_rows=np.array([2, 0]))
    assert la.shape == lb.shape == (2, model.config.vocab_size)
    assert np.max(np.abs(la - lb)) <= 1e-4 * (lb.max() - lb.min())
    assert np.array_equal(np.argmax(la, axis=1), np.argmax(lb, axis=1))


class _Batched:
    """One token per sequence: row j attends with sequence j's own cache."""

    def __init__(self, caches: list[DenseAttention]) -> None:
        self.caches = caches

    def attend(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        rows = [c.attend(layer, q[j : j + 1], k[j : j + 1], v[j : j + 1]) for j, c in enumerate(self.caches)]
        return np.concatenate(rows, axis=0)
