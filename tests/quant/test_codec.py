"""Round trips of the quantized formats, with the bounds docs/quantized_kv.md states.

- fp8 e4m3: vLLM's own tolerance for its fp8 cache (tests/kernels/attention/test_cache.py:
  ``assert_close(..., atol=0.001, rtol=0.1)`` on standard-normal keys and values), here with our
  per-(token, head) UE5M3 scales; and vLLM's per-tensor scale ``amax / 64`` through our e4m3
  conversion alone.
- int8: every element within half a step of its row's scale (up to the rounding of ``x / s``),
  ``|x - x^| <= s / 2 < (9/16) amax / 127`` (amax: the row's, i.e. the (token, head)'s, absolute
  maximum; 9/8 is UE5M3's largest ratio between neighbouring scales), no code clipped, inside
  the scale's range; beyond it the row saturates at +-127 codes of the largest scale.
- int4: every element within its group's half step ``h``, and ``h`` bounded by the group's own
  half-range: ``h < (5/4) (r + cstep / 2) / 15`` (r: half the group's max - min, cstep: the
  block-head's center-grid step; 5/4 is the ladder's largest ratio between neighbouring levels)
  unless the group sits on the ladder's smallest level.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from pagedkv.attention.kv_cache_dtype import block_layout
from pagedkv.attention.quant_codec import (
    INT4_LEVELS,
    decode_blocks,
    dequantize_8bit,
    encode_blocks,
    int4_decode,
    int4_encode,
    int4_group_params,
    quantize_8bit,
)
from pagedkv.attention.small_floats import (
    bf16_bits_to_float32,
    e4m3_to_float32,
    float32_to_e4m3,
    ue5m3_to_float32,
)

F32 = np.float32


@pytest.mark.parametrize("head_size", [64, 80, 256])  # vLLM's HEAD_SIZES
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_fp8_round_trip_within_vllms_tolerance(head_size, dtype):
    rng = np.random.default_rng(head_size)
    x = rng.standard_normal((42, 8, head_size)).astype(dtype).astype(F32)  # vLLM: 42 tokens, 8 heads
    codes, scales = quantize_8bit(x, "fp8_e4m3")
    np.testing.assert_allclose(dequantize_8bit(codes, scales, "fp8_e4m3"), x, atol=0.001, rtol=0.1)


def test_fp8_conversion_with_vllms_per_tensor_scale():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((42, 8, 64)).astype(F32)
    scale = F32(x.max() / 64.0)  # vLLM's "default kv_scale"
    back = e4m3_to_float32(float32_to_e4m3(x / scale)) * scale
    np.testing.assert_allclose(back, x, atol=0.001, rtol=0.1)


finite_rows = hnp.arrays(
    F32,
    st.tuples(st.integers(1, 6), st.integers(1, 3), st.sampled_from([8, 64])),
    elements=st.floats(-(2.0**100), 2.0**100, allow_nan=False, width=32),
)


@settings(max_examples=150, deadline=None)
@given(x=finite_rows, magnitude=st.sampled_from([1e-30, 1e-3, 1.0, 1e3]))
def test_int8_error_is_within_half_a_step_below_amax_over_226(x, magnitude):
    x = (x / np.float32(2.0**100) * np.float32(magnitude)).astype(F32)
    codes, scales = quantize_8bit(x, "int8")
    back = dequantize_8bit(codes, scales, "int8")
    s = ue5m3_to_float32(scales)[..., None]
    amax = np.abs(x).max(axis=-1, keepdims=True)
    err = np.abs(back - x)
    # round to nearest of x / s (itself rounded: 2^-24 of at most 127.5): half a step
    assert (err <= s / 2 * (1 + 2.0**-16)).all()
    in_range = amax >= F32(127 * 2.0**-22)  # the smallest scale is 2^-22: below, the bound is absolute
    assert (err <= np.where(in_range, amax * (9 / 16 / 127) * (1 + 2.0**-16), F32(2.0**-23))).all()
    assert (codes.view(np.int8) != -128).all()  # symmetric: -128 is never produced


def test_8bit_rows_beyond_the_scale_range_saturate():
    x = np.zeros((2, 64), F32)
    x[0, :2] = [5e5, -1.0]  # amax above 448 * 1.75 * 2^9 (the largest scale)
    x[1, :2] = [1e9, -2e9]
    for dtype, top, byte, scale in (("int8", 127.0, 0xFE, 896.0), ("fp8_e4m3", 448.0, 0xF8, 512.0)):
        codes, scales = quantize_8bit(x, dtype)
        assert scales.tolist() == [byte, byte]
        back = dequantize_8bit(codes, scales, dtype)
        assert back[0, 0] == top * scale and back[1, 0] == top * scale and back[1, 1] == -top * scale
        assert np.isfinite(back).all()


@settings(max_examples=100, deadline=None)
@given(x=finite_rows, magnitude=st.sampled_from([1e-2, 1.0, 1e3]))
def test_fp8_scales_are_powers_of_two_so_codes_are_x_rounded_to_e4m3(x, magnitude):
    """e4m3 takes the power-of-two UE5M3 bytes: ``x / s`` is exact, so each code is ``x`` itself
    rounded to e4m3 (shifted by the scale's exponent), with no second rounding."""
    x = (x / np.float32(2.0**100) * np.float32(magnitude)).astype(F32)
    codes, scales = quantize_8bit(x, "fp8_e4m3")
    assert (scales % 8 == 0).all()
    s = ue5m3_to_float32(scales)[..., None]
    np.testing.assert_array_equal(codes, float32_to_e4m3(x * (np.float32(1) / s)))  # 1 / s exact


def test_8bit_rows_with_nan_or_infinity_decode_to_nan_and_leave_other_rows_alone():
    x = np.ones((3, 2, 64), F32)
    x[0, 1, 5] = np.nan
    x[2, 0, 0] = np.inf
    for dtype in ("int8", "fp8_e4m3"):
        back = dequantize_8bit(*quantize_8bit(x, dtype), dtype)
        assert np.isnan(back[0, 1]).all() and np.isnan(back[2, 0]).all()
        alone = dequantize_8bit(*quantize_8bit(x[1], dtype), dtype)  # the finite rows, quantized alone
        np.testing.assert_array_equal(back[1], alone)
        np.testing.assert_array_equal(back[0, 0], alone[0])


def _check_int4(x: np.ndarray) -> None:
    codes, meta, side = int4_encode(x)
    assert codes.max() <= 15
    back = int4_decode(codes, meta, side)
    chat, half = int4_group_params(meta, side)
    err = np.abs(back - x)
    slack = np.abs(x) * F32(2.0**-22) + F32(1e-37)  # the final add's rounding (and the t computation's)
    assert (err <= half[:, :, None] * (1 + 2.0**-20) + slack).all()
    mn, mx = x.min(axis=2), x.max(axis=2)
    cstep = bf16_bits_to_float32(side[:, 1])[:, None]
    r = (mx.astype(np.float64) - mn) / 2
    level = meta & 0xF
    bound = 1.25 * (r + cstep / 2) / 15 * (1 + 1e-6) + 1e-37
    assert ((half <= bound) | (level == 15)).all()
    # the center is computed in float32 (min/2 + max/2): subnormal halves round, hence the 1e-37
    assert (np.abs(chat - (mn.astype(np.float64) + mx) / 2) <= r + cstep + 1e-37).all()


@settings(max_examples=150, deadline=None)
@given(
    x=hnp.arrays(
        F32,
        st.tuples(st.integers(1, 4), st.integers(1, 64), st.integers(1, 32)),
        elements=st.floats(-1000, 1000, allow_nan=False, width=32),
    ),
    offsets=st.booleans(),
)
def test_int4_error_is_within_each_groups_half_step(x, offsets):
    if offsets:  # key-like outlier channels: large per-group offsets, small ranges
        x = x * F32(0.01) + np.arange(x.shape[1], dtype=F32)[None, :, None] * F32(37)
    _check_int4(x.astype(F32))


def test_int4_on_normal_data_and_constant_groups():
    rng = np.random.default_rng(1)
    _check_int4(rng.standard_normal((8, 64, 16)).astype(F32))
    const = np.full((2, 5, 16), 3.25, F32)
    codes, meta, side = int4_encode(const)
    np.testing.assert_array_equal(int4_decode(codes, meta, side), const)  # zero range: exact
    zeros = np.zeros((1, 4, 4), F32)
    np.testing.assert_array_equal(int4_decode(*int4_encode(zeros)), zeros)


def test_int4_sets_with_nan_or_infinity_decode_to_nan():
    x = np.ones((3, 8, 16), F32)
    x[1, 2, 3] = np.inf
    back = int4_decode(*int4_encode(x))
    assert np.isnan(back[1]).all()
    np.testing.assert_array_equal(back[0], x[0])


def test_the_ladder_is_exact_and_decreasing():
    assert INT4_LEVELS[0] == 1 and (np.diff(INT4_LEVELS) < 0).all()
    # three significant bits each: a level times a bfloat16 (8 bits) is exact in float32
    mantissas = INT4_LEVELS / 2.0 ** np.floor(np.log2(INT4_LEVELS))
    assert ((mantissas * 4) % 1 == 0).all()


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3", "int4"])
@pytest.mark.parametrize("role", ["key", "value"])
@pytest.mark.parametrize("block_size", [1, 8, 16])
def test_blocks_encode_and_decode_through_their_layout(dtype, role, block_size):
    rng = np.random.default_rng(block_size)
    lay = block_layout(dtype, role, block_size, 3, 64)
    x = rng.standard_normal((5, block_size, 3, 64)).astype(F32)
    data = encode_blocks(x, lay)
    assert data.shape == (5, lay.block_bytes) and data.dtype == np.uint8
    assert (data[:, lay.side_offset + lay.side_bytes :] == 0).all()  # padding is zero
    back = decode_blocks(data, lay)
    tolerance = {"int8": 1 / 127, "fp8_e4m3": 0.07, "int4": 0.25}[dtype]
    assert np.abs(back - x).max() <= tolerance * np.abs(x).max()
    # a block decodes on its own: the layout carries all of its scales
    np.testing.assert_array_equal(decode_blocks(data[2:3], lay)[0], back[2])
