"""fp8 e4m3, UE5M3 and directed bfloat16 rounding against their definitions and ml_dtypes.

``float32_to_e4m3`` must round exactly as CUDA's ``__nv_fp8_e4m3`` (round to nearest even,
saturating): within e4m3's range that is ml_dtypes' ``float8_e4m3fn`` conversion bit for bit;
beyond it CUDA saturates to +-448 where ml_dtypes gives NaN, which is checked on its own."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedkv.attention.small_floats import (
    bf16_bits_to_float32,
    bf16_round_down,
    bf16_round_up,
    e4m3_to_float32,
    float32_to_e4m3,
    ue5m3_scale_for,
    ue5m3_to_float32,
)

ml_dtypes = pytest.importorskip("ml_dtypes", reason="pip install ml_dtypes (in the test extra)")
E4M3 = ml_dtypes.float8_e4m3fn
SATURATION = np.float32(464.0)  # 448 + half an ulp: above it ml_dtypes overflows to NaN, CUDA saturates


def _ml(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(E4M3).view(np.uint8)


def test_every_code_decodes_as_ml_dtypes_and_round_trips():
    codes = np.arange(256, dtype=np.uint8)
    ours = e4m3_to_float32(codes)
    np.testing.assert_array_equal(ours, codes.view(E4M3).astype(np.float32))
    finite = ~np.isnan(ours)
    np.testing.assert_array_equal(float32_to_e4m3(ours[finite]), codes[finite])
    assert np.isnan(ours).sum() == 2  # 0x7F and 0xFF: e4m3fn has no infinities


def test_midpoints_and_boundaries_round_to_nearest_even_as_ml_dtypes():
    values = np.unique(e4m3_to_float32(np.arange(256, dtype=np.uint8)))
    values = values[~np.isnan(values)].astype(np.float64)
    mids = (values[:-1] + values[1:]) / 2
    probes = np.concatenate([mids, np.nextafter(mids, -np.inf), np.nextafter(mids, np.inf)]).astype(
        np.float32
    )
    probes = probes[np.abs(probes) <= SATURATION]
    np.testing.assert_array_equal(float32_to_e4m3(probes), _ml(probes))


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64))
def test_any_float32_in_range_converts_as_ml_dtypes(bit_patterns):
    x = np.array(bit_patterns, dtype=np.uint32).view(np.float32)
    in_range = np.isfinite(x) & (np.abs(x) <= SATURATION)
    np.testing.assert_array_equal(float32_to_e4m3(x[in_range]), _ml(x[in_range]))
    assert np.isnan(e4m3_to_float32(float32_to_e4m3(x[np.isnan(x)]))).all()


def test_saturation_zero_and_nan_follow_cuda():
    x = np.array(
        [448, 463.9, 464, 464.01, 1e30, np.inf, -np.inf, -500, 2**-10, 2**-10 * 1.001, -(2**-11)], np.float32
    )
    got = e4m3_to_float32(float32_to_e4m3(x))
    expected = [448, 448, 448, 448, 448, 448, -448, -448, 0, 2**-9, -0.0]
    np.testing.assert_array_equal(got, np.array(expected, np.float32))
    assert float32_to_e4m3(np.array([-0.0], np.float32))[0] == 0x80
    nan = float32_to_e4m3(np.array([np.nan, -np.nan], np.float32))
    assert nan.tolist() == [0x7F, 0xFF]  # the sign bit kept, as CUDA's conversion does


UE5M3_VALUES = ue5m3_to_float32(np.arange(255, dtype=np.uint8)).astype(np.float64)


def test_ue5m3_bytes_are_one_plus_m_eighths_times_a_power_of_two():
    b = np.arange(255)
    want = (1 + (b & 7) / 8) * np.exp2((b >> 3) - 22.0)
    np.testing.assert_array_equal(UE5M3_VALUES, want)
    assert UE5M3_VALUES[0] == 2.0**-22 and UE5M3_VALUES[254] == 1.75 * 2.0**9


@settings(max_examples=300, deadline=None)
@given(
    amax=st.one_of(
        st.floats(0, 2.0**127, allow_nan=False, allow_subnormal=True, width=32),
        st.floats(2.0**-18, 2.0**19, width=32),  # the format's range for int8 and e4m3
        st.sampled_from([float(v) * m for v in UE5M3_VALUES for m in (127.0, 448.0)]),  # exact ties
    ),
    max_code=st.sampled_from((127.0, 448.0)),
)
def test_ue5m3_scale_is_the_smallest_byte_that_covers(amax, max_code):
    amax32 = np.float32(amax)
    b = int(ue5m3_scale_for(np.array([amax32], np.float32), max_code)[0])
    covering = np.flatnonzero(float(amax32) <= max_code * UE5M3_VALUES)
    assert b == (covering[0] if covering.size else 254)  # the smallest, or saturated at 0xFE
    # powers of two only (e4m3's scales): the smallest byte with mantissa 0, or 0xF8 (2^9)
    b = int(ue5m3_scale_for(np.array([amax32], np.float32), max_code, power_of_two=True)[0])
    covering = covering[covering % 8 == 0]
    assert b == (covering[0] if covering.size else 248)


def test_ue5m3_of_nan_and_infinity_is_nan():
    got = ue5m3_scale_for(np.array([np.nan, np.inf, 0.0], np.float32), 127)
    assert got.tolist() == [0xFF, 0xFF, 0]
    assert np.isnan(ue5m3_to_float32(np.array([0xFF], np.uint8))[0])


@settings(max_examples=300, deadline=None)
@given(st.floats(-(2.0**127), 2.0**127, allow_nan=False, width=32))
def test_bf16_directed_rounding_brackets_the_value_tightly(x):
    up = float(bf16_bits_to_float32(bf16_round_up(np.array([x], np.float32)))[0])
    down = float(bf16_bits_to_float32(bf16_round_down(np.array([x], np.float32)))[0])
    assert down <= x <= up
    if up != down:  # inexact: neighbours, nothing representable in between
        assert np.nextafter(np.float32(down), np.float32(np.inf)).astype(np.float32) <= np.float32(x)
        hi = bf16_round_up(np.array([down], np.float32))
        assert (
            float(
                bf16_bits_to_float32(
                    bf16_round_up(np.array([np.nextafter(np.float32(down), np.float32(np.inf))], np.float32))
                )[0]
            )
            == up
        )
        assert float(bf16_bits_to_float32(hi)[0]) == down
