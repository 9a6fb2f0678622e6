"""The block-quantized projection kernel (``pagedkv.models.block_weights``) against NumPy, and the
llama model's default ``quantized`` weight mode against its fp32 mode on the real SmolLM2 file.

Tolerance: the weights are bit-identical to the fp32 dequantization (checked exactly); the kernel
then sums fp32 products in input order with fused multiply-adds, so each output is within
``k * 2^-24 * sum_i |x_i w_i|`` (plus 1e-30) of the exact product, computed here in float64.
Hostile arguments raise ``InvalidArgumentError``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedkv import _core
from pagedkv.errors import InvalidArgumentError
from pagedkv.models.block_weights import PANEL_COLS, BlockWeights

from cpu.block_codes_cases import CODE_RANGES, random_codes
from cpu.dense_attention import DenseAttention
from cpu.smollm2_models import smollm2_and_fp32_twin

_CODE_RANGES = CODE_RANGES
_codes = random_codes


@settings(max_examples=120, deadline=None)
@given(
    st.integers(0, 13),
    st.integers(0, 5),
    st.sampled_from([16, 32]),
    st.integers(1, 70),
    st.sampled_from(sorted(_CODE_RANGES)),
    st.integers(0, 2**31),
)
def test_matmul_matches_float64_reference(
    t: int, blocks: int, block: int, n: int, fmt: str, seed: int
) -> None:
    k = blocks * block
    codes = _codes(n, k, block, seed, fmt=fmt)
    w = BlockWeights(codes)
    assert w.code_format == fmt or k == 0
    x = np.random.default_rng(seed + 1).standard_normal((t, k)).astype(np.float32)
    got = w.matmul(x)
    wide = w.to_f32().astype(np.float64)
    want = x.astype(np.float64) @ wide
    bound = max(k, 1) * 2.0**-24 * (np.abs(x.astype(np.float64)) @ np.abs(wide)) + 1e-30
    assert got.shape == (t, n) and got.dtype == np.float32
    assert np.all(np.abs(got - want) <= bound)


def test_weights_are_the_fp32_dequantization_bit_for_bit() -> None:
    codes = _codes(37, 64, 32, 3)
    dense = codes.scales.repeat(32, axis=1) * codes.codes.astype(np.float32) + codes.offsets.repeat(
        32, axis=1
    )
    assert np.array_equal(BlockWeights(codes).to_f32().view(np.uint32), dense.T.view(np.uint32))


@pytest.mark.parametrize("fmt", sorted(_CODE_RANGES))
@pytest.mark.parametrize("t", [3, 6, 11])  # the register path (up to 4 rows) and the panel path
def test_each_output_is_the_in_order_fma_chain(fmt: str, t: int) -> None:
    """The kernel's arithmetic exactly: acc = fma(x_i, w_i, acc) for i in order (emulated in
    float64, which holds each fp32 product exactly, rounding the sum to fp32 at every step)."""
    codes = _codes(19, 64, 16, 5, fmt=fmt)
    w = BlockWeights(codes)
    x = np.random.default_rng(6).standard_normal((t, 64)).astype(np.float32)
    wide = w.to_f32().astype(np.float64)
    acc = np.zeros((t, 19), np.float32)
    for i in range(64):
        acc = (acc.astype(np.float64) + x[:, i : i + 1].astype(np.float64) * wide[i]).astype(np.float32)
    assert np.array_equal(w.matmul(x).view(np.uint32), acc.view(np.uint32))


@pytest.mark.parametrize("fmt", sorted(_CODE_RANGES))
def test_a_row_does_not_depend_on_its_batch(fmt: str) -> None:
    w = BlockWeights(_codes(150, 96, 32, 1, fmt=fmt))
    x = np.random.default_rng(1).standard_normal((11, 96)).astype(np.float32)
    whole = w.matmul(x)
    for i in range(11):
        assert np.array_equal(w.matmul(x[i : i + 1])[0], whole[i])


def test_fused_matrices_with_different_blocks_keep_every_weight() -> None:
    a, b = _codes(5, 64, 32, 7), _codes(20, 64, 16, 8)
    fused = BlockWeights.from_codes(a, b)
    assert fused.block == 16 and fused.out_features == 25
    whole = np.concatenate([BlockWeights(a).to_f32(), BlockWeights(b).to_f32()], axis=1)
    assert np.array_equal(fused.to_f32().view(np.uint32), whole.view(np.uint32))
    with pytest.raises(InvalidArgumentError, match="width"):
        BlockWeights.from_codes(a, _codes(5, 32, 32, 9))
    with pytest.raises(InvalidArgumentError, match="at least one"):
        BlockWeights.from_codes()


def test_nan_and_inf_activations_propagate_only_to_their_rows() -> None:
    w = BlockWeights(_codes(20, 32, 32, 2))
    x = np.ones((3, 32), np.float32)
    x[1, 5] = np.nan
    x[2, 0] = np.inf
    out = w.matmul(x)
    assert np.all(np.isfinite(out[0])) and np.all(np.isnan(out[1])) and not np.any(np.isfinite(out[2]))


_W = BlockWeights(_codes(4, 32, 32, 0))
_C, _S, _O = _W.codes, _W.scales, _W.offsets
_X = np.ones((2, 32), np.float32)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((_X.astype(np.float64), _C, _S, _O, 4, 32, "i8"), "float32"),
        (([[1.0] * 32], _C, _S, _O, 4, 32, "i8"), "float32"),
        ((_X, _C.view(np.int8), _S, _O, 4, 32, "i8"), "uint8"),
        ((_X, _C, _S.astype(np.float16), _O, 4, 32, "i8"), "float32"),
        ((_X, _C, _S, _O.astype(np.float64), 4, 32, "i8"), "float32"),
        ((_X[0], _C, _S, _O, 4, 32, "i8"), "2-D"),
        ((_X, _C[0], _S, _O, 4, 32, "i8"), "3-D"),
        ((_X, _C, _S, _O, 4, 0, "i8"), "block"),
        ((_X, _C, _S, _O, 4, 5, "i8"), "block"),
        ((_X, _C, _S, _O, 4, 16, "i8"), "scales"),
        ((_X, _C, _S, _O, PANEL_COLS + 1, 32, "i8"), "codes must be"),
        ((np.ones((2, 64), np.float32), _C, _S, _O, 4, 32, "i8"), "codes must be"),
        ((_X, _C, _S, _O[:, :0], 4, 32, "i8"), "offsets"),
        ((_X, _C, _S, _O, 4, 32, "u4"), "codes must be"),  # 16-byte rows given as 4-bit codes
        ((_X, _C, _S, _O, 4, 32, "q4"), "code_format"),
        (
            (_X, np.ascontiguousarray(_C.transpose(0, 2, 1)).transpose(0, 2, 1), _S, _O, 4, 32, "i8"),
            "C-contiguous",
        ),
    ],
)
def test_hostile_arguments_are_refused(args: tuple[object, ...], match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        _core.cpu_matmul_blocks(*args)  # type: ignore[arg-type]


def test_negative_sizes_are_refused() -> None:
    with pytest.raises(OverflowError):
        _core.cpu_matmul_blocks(_X, _C, _S, _O, -1, 32, "i8")
    with pytest.raises(OverflowError):
        _core.cpu_matmul_blocks(_X, _C, _S, _O, 4, -32, "i8")


def test_empty_batches_and_widths() -> None:
    assert _W.matmul(np.zeros((0, 32), np.float32)).shape == (0, 4)
    empty = BlockWeights(_codes(3, 0, 32, 0))
    assert np.array_equal(empty.matmul(np.zeros((2, 0), np.float32)), np.zeros((2, 3), np.float32))


def test_smollm2_runs_on_its_file_codes_and_matches_fp32() -> None:
    """The real model's default mode: every projection on the block kernel, the same greedy
    tokens as the fp32 (BLAS) mode and logits within 1e-4 of their range over a prefill of 9
    tokens and 6 decode steps (the weights are equal; only the summation order differs)."""
    from pagedkv.models.llama import LlamaModel

    model, ref = smollm2_and_fp32_twin()
    assert isinstance(model, LlamaModel) and model.weight_dtype == "quantized"
    projections = [*model._wqkv, *model._wo, *model._w_gate_up, *model._w_down, model._output]
    assert {p.kernel for p in projections} == {"blocks"}
    a, b = DenseAttention(), DenseAttention()
    tokens, pos = np.array([1, 504, 3458, 314, 260, 4371, 282, 4649, 30]), np.arange(9)
    for _ in range(7):
        la, lb = model.forward(tokens, pos, a)[-1], ref.forward(tokens, pos, b)[-1]
        assert np.max(np.abs(la - lb)) <= 1e-4 * (lb.max() - lb.min())
        assert int(np.argmax(la)) == int(np.argmax(lb))
        tokens, pos = np.array([int(np.argmax(lb))]), pos[-1:] + 1
