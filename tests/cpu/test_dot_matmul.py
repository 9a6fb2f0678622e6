"""The ``int8`` projection kernel (``pagedkv.models.dot_weights``: 8-bit activations, integer dot
products) against a NumPy model of its formula, and the ``int8`` weight mode on the real model.

Tolerances: the formula (``dot_weights`` docs) is computed here in float64 from the same
activation codes; the kernel's fp32 arithmetic (one product and two fused multiply-adds per block)
stays within ``4 * nb * 2^-24`` of the sum of the terms' magnitudes. Against the exact fp32
product the error is the activations' rounding: at most half a step (``max|x| / 254`` of the
block) times ``sum |w|`` per block. Hostile arguments raise ``InvalidArgumentError``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedkv import _core
from pagedkv.errors import InvalidArgumentError
from pagedkv.models.block_codes import BlockCodes
from pagedkv.models.block_weights import BlockWeights
from pagedkv.models.dot_weights import DotWeights

from cpu.block_codes_cases import CODE_RANGES, random_codes
from cpu.dense_attention import DenseAttention
from cpu.smollm2_models import smollm2_and_fp32_twin

_CODE_RANGES = CODE_RANGES


def _codes(n: int, k: int, block: int, seed: int, fmt: str = "u4") -> BlockCodes:
    return random_codes(n, k, block, seed, fmt)


def _formula(codes: BlockCodes, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The documented sums in float64 from the kernel's activation codes: ``(out, magnitude)``
    where ``magnitude`` sums the terms' absolute values (the rounding bound's scale)."""
    t, k = x.shape
    n, block = codes.codes.shape[0], codes.block
    nb = k // block
    xb = x.reshape(t, nb, block)
    amax = np.abs(xb).max(axis=2, initial=0.0)
    inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    # Rust's f32::round rounds half away from zero (NumPy's round: half to even).
    scaled = xb * inv[..., None]
    a = np.clip(np.trunc(scaled.astype(np.float64) + np.copysign(0.5, scaled)), -127, 127).astype(np.int64)
    q = codes.codes.reshape(n, nb, block).astype(np.int64)
    isum = np.einsum("tbi,nbi->tnb", a, q).astype(np.float64)  # exact
    dx = (amax / np.float32(127)).astype(np.float32)
    step = codes.scales.astype(np.float32)[None, :, :] * dx[:, None, :]
    xsum = (dx * a.sum(axis=2).astype(np.float32)).astype(np.float64)  # the quantized sum, in fp32
    scaled, offset = step.astype(np.float64) * isum, codes.offsets.astype(np.float64)[None] * xsum[:, None, :]
    return (scaled + offset).sum(axis=2), (np.abs(scaled) + np.abs(offset)).sum(axis=2)


@settings(max_examples=120, deadline=None)
@given(
    st.integers(0, 19),
    st.integers(0, 5),
    st.sampled_from([16, 32]),
    st.integers(1, 70),
    st.sampled_from(sorted(_CODE_RANGES)),
    st.integers(0, 2**31),
)
def test_matmul_is_the_documented_formula(
    t: int, blocks: int, block: int, n: int, fmt: str, seed: int
) -> None:
    k = blocks * block
    codes = _codes(n, k, block, seed, fmt)
    w = DotWeights(codes)
    assert w.code_format == fmt or k == 0
    x = (np.random.default_rng(seed + 1).standard_normal((t, k)) * 3).astype(np.float32)
    got = w.matmul(x)
    want, mag = _formula(codes, x)
    assert got.shape == (t, n) and got.dtype == np.float32
    assert np.all(np.abs(got - want) <= 4 * max(blocks, 1) * 2.0**-24 * mag + 1e-30)


@pytest.mark.parametrize("fmt", sorted(_CODE_RANGES))
def test_the_error_is_the_activations_rounding(fmt: str) -> None:
    codes = _codes(40, 192, 32, 5, fmt)
    x = np.random.default_rng(6).standard_normal((9, 192)).astype(np.float32)
    got = DotWeights(codes).matmul(x).astype(np.float64)
    w = codes.dequantize().astype(np.float64)  # [n, k]
    exact = x.astype(np.float64) @ w.T
    xb = np.abs(x).reshape(9, 6, 32).max(axis=2) / 127  # the step per row and block
    bound = (xb[:, None, :] / 2 * np.abs(w).reshape(40, 6, 32).sum(axis=2)[None]).sum(axis=2)
    assert np.all(np.abs(got - exact) <= bound * 1.001 + 1e-5)
    assert np.max(np.abs(got - exact)) > 0  # the activations really are rounded


@pytest.mark.parametrize("fmt", sorted(_CODE_RANGES))
def test_a_row_does_not_depend_on_its_batch(fmt: str) -> None:
    w = DotWeights(_codes(37, 64, 16, 3, fmt))
    x = np.random.default_rng(4).standard_normal((203, 64)).astype(np.float32)  # > two 96-row chunks
    whole = w.matmul(x)
    for j in (0, 7, 8, 95, 96, 202):
        assert np.array_equal(w.matmul(x[j : j + 1]).view(np.uint32), whole[j : j + 1].view(np.uint32))


def test_fused_parts_equal_the_parts_alone() -> None:
    a, b = _codes(20, 64, 32, 1, "u4"), _codes(7, 64, 16, 2, "u4")
    x = np.random.default_rng(3).standard_normal((5, 64)).astype(np.float32)
    fused = DotWeights.from_codes(a, b).matmul(x)
    # b's blocks of 16 make the fused matrix quantize activations per 16: a alone in blocks of 16.
    alone = np.concatenate([DotWeights(a.split_blocks(16)).matmul(x), DotWeights(b).matmul(x)], axis=1)
    assert np.array_equal(fused, alone)


def test_zeros_nan_and_inf_rows() -> None:
    w = DotWeights(_codes(20, 32, 32, 2))
    x = np.ones((4, 32), np.float32)
    x[1, 5] = np.nan
    x[2, 0] = np.inf
    x[3] = 0
    out = w.matmul(x)
    assert np.all(np.isfinite(out[0])) and not np.any(np.isfinite(out[1:3]))
    assert np.array_equal(out[3], np.zeros(20, np.float32))


_W = DotWeights(_codes(4, 32, 32, 0, "i8"))
_C, _S, _O = _W.codes, _W.scales, _W.offsets
_X = np.ones((2, 32), np.float32)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((_X.astype(np.float64), _C, _S, _O, 4, 32, "i8"), "float32"),
        ((_X, _C.view(np.int8), _S, _O, 4, 32, "i8"), "uint8"),
        ((_X, _C, _S.astype(np.float16), _O, 4, 32, "i8"), "float32"),
        ((_X[0], _C, _S, _O, 4, 32, "i8"), "2-D"),
        ((_X, _C[0], _S, _O, 4, 32, "i8"), "3-D"),
        ((_X, _C, _S, _O, 4, 0, "i8"), "block"),
        ((_X, _C, _S, _O, 4, 6, "i8"), "block"),
        ((_X, _C, _S, _O, 4, 4, "u4"), "block"),
        ((_X, _C, _S, _O, 4, 16, "i8"), "scales"),
        ((np.ones((2, 512), np.float32), _C, _S, _O, 4, 512, "i8"), "at most 256"),
        ((_X, _C, _S, _O, 17, 32, "i8"), "codes must be"),
        ((_X, _C, _S, _O, 4, 32, "u4"), "codes must be"),  # 4-input groups given as 8-input ones
        ((_X, _C, _S, _O, 4, 32, "q8"), "code_format"),
    ],
)
def test_hostile_arguments_are_refused(args: tuple[object, ...], match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        _core.cpu_matmul_dot(*args)  # type: ignore[arg-type]


def test_blocks_the_kernel_cannot_sum_exactly_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="multiple of 8"):
        DotWeights(_codes(4, 36, 4, 0, "u4"))
    with pytest.raises(InvalidArgumentError, match="at most 256"):
        DotWeights(_codes(4, 512, 512, 0, "i8"))


def test_int8_projections_keep_blocks_the_kernel_cannot_take_on_the_exact_kernel() -> None:
    from pagedkv.models.projection import Projection

    def unused() -> np.ndarray:
        raise AssertionError("the fp32 matrix must not be built")

    odd = _codes(5, 36, 4, 1, "u4")  # blocks of 4: not whole 8-input groups of 4-bit codes
    x = np.random.default_rng(2).standard_normal((3, 36)).astype(np.float32)
    proj = Projection("int8", unused, [odd])
    assert proj.kernel == "blocks" and DotWeights.fits(odd) is False
    assert np.array_equal(proj(x), BlockWeights(odd).matmul(x))
    assert Projection("int8", unused, [_codes(5, 64, 32, 1)]).kernel == "dot"


def test_empty_batches_and_widths() -> None:
    assert _W.matmul(np.zeros((0, 32), np.float32)).shape == (0, 4)
    empty = DotWeights(_codes(3, 0, 32, 0))
    assert np.array_equal(empty.matmul(np.zeros((2, 0), np.float32)), np.zeros((2, 3), np.float32))


def test_smollm2_in_int8_mode_follows_the_fp32_model() -> None:
    """The real model with ``weights="int8"``: every projection on the dot kernel; over a prefill
    of 9 tokens and 6 greedy decode steps the logits stay within 10 % of their range of the fp32
    model's (a wrong code layout is off by more than the range) and pick the same token."""
    from pagedkv.models.llama import LlamaModel

    quantized, ref = smollm2_and_fp32_twin()
    model = LlamaModel(quantized.weights, weights="int8")
    projections = [*model._wqkv, *model._wo, *model._w_gate_up, *model._w_down, model._output]
    assert {p.kernel for p in projections} == {"dot"}
    a, b = DenseAttention(), DenseAttention()
    tokens, pos = np.array([1, 504, 3458, 314, 260, 4371, 282, 4649, 30]), np.arange(9)
    for _ in range(7):
        la, lb = model.forward(tokens, pos, a)[-1], ref.forward(tokens, pos, b)[-1]
        assert np.max(np.abs(la - lb)) <= 0.10 * (lb.max() - lb.min())
        assert int(np.argmax(la)) == int(np.argmax(lb))
        tokens, pos = np.array([int(np.argmax(lb))]), pos[-1:] + 1
