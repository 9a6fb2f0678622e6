"""The emulated tensor-core instructions (cuda_emu_mma.h through mma_sm80.h) against NumPy.

Layouts are checked with small integers, so every product and sum is exact whatever the
accumulation order, and any misplaced fragment element changes the result; a float round
checks the fp32 accumulation within a stated tolerance (1e-6 relative).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pagedkv.attention.dtypes import bf16_bits_to_float32, float32_to_bf16_bits
from pagedkv.kernels import emulation

from .conftest import needs_cxx

pytestmark = needs_cxx
HERE = Path(__file__).resolve().parent
PROBES = "harness_mma.cu"
TYPES = {"float16": "pagedkv::f16", "bfloat16": "pagedkv::bf16"}
NAMES = [
    *(f"pagedkv::mma_fragment_probe<{t}>" for t in TYPES.values()),
    *(f"pagedkv::ldmatrix_mma_probe<{t}>" for t in TYPES.values()),
    *(f"pagedkv::pack_probe<{t}>" for t in TYPES.values()),
    "pagedkv::ldmatrix_probe",
    "pagedkv::cp_async_probe",
    "pagedkv::partial_warp_mma_probe",
    "pagedkv::ldmatrix_global_probe",
]


@pytest.fixture(scope="module", autouse=True)
def built():
    emulation.prebuild([(PROBES, n) for n in NAMES], source_dir=HERE)


def probe(name: str) -> emulation.EmulatedKernel:
    return emulation.get_kernel(PROBES, name, source_dir=HERE)


def bits(x: np.ndarray, kind: str) -> np.ndarray:
    if kind == "bfloat16":
        return float32_to_bf16_bits(x.astype(np.float32))
    with np.errstate(over="ignore"):  # 65520 rounds to inf in fp16, as cvt.rn does
        return x.astype(np.float16).view(np.uint16)


def values(b: np.ndarray, kind: str) -> np.ndarray:
    if kind == "bfloat16":
        return bf16_bits_to_float32(b).astype(np.float64)
    return b.view(np.float16).astype(np.float64)


@pytest.mark.parametrize("kind", list(TYPES))
@pytest.mark.parametrize("integers", [True, False])
def test_mma_fragments_follow_the_ptx_layout(kind, integers):
    rng = np.random.default_rng(1 if integers else 2)
    if integers:
        a = bits(rng.integers(-8, 9, (16, 16)).astype(np.float32), kind)
        bt = bits(rng.integers(-8, 9, (8, 16)).astype(np.float32), kind)
        c = rng.integers(-100, 101, (16, 8)).astype(np.float32)
    else:
        a = bits(rng.standard_normal((16, 16)).astype(np.float32), kind)
        bt = bits(rng.standard_normal((8, 16)).astype(np.float32), kind)
        c = rng.standard_normal((16, 8)).astype(np.float32)
    d = np.full((16, 8), np.nan, np.float32)
    probe(f"pagedkv::mma_fragment_probe<{TYPES[kind]}>").launch((1, 1, 1), (32, 1, 1), [d, a, bt, c])
    expected = values(a, kind) @ values(bt, kind).T + c
    if integers:
        assert np.array_equal(d, expected.astype(np.float32))
    else:
        np.testing.assert_allclose(d, expected, rtol=1e-6, atol=1e-6)


def test_ldmatrix_plain_and_transposed():
    m = np.arange(4 * 8 * 8, dtype=np.uint16).reshape(4, 8, 8)
    out = np.zeros((32, 8), np.uint32)
    probe("pagedkv::ldmatrix_probe").launch((1, 1, 1), (32, 1, 1), [out, m])
    lane = np.arange(32)
    for j in range(4):
        lo = m[j, lane // 4, 2 * (lane % 4)].astype(np.uint32)
        hi = m[j, lane // 4, 2 * (lane % 4) + 1].astype(np.uint32)
        assert np.array_equal(out[:, j], lo | hi << 16), f"x4 register {j}"
        lo = m[j, 2 * (lane % 4), lane // 4].astype(np.uint32)
        hi = m[j, 2 * (lane % 4) + 1, lane // 4].astype(np.uint32)
        assert np.array_equal(out[:, 4 + j], lo | hi << 16), f"x4.trans register {j}"


@pytest.mark.parametrize("kind", list(TYPES))
def test_ldmatrix_feeds_mma_as_the_attention_kernels_do(kind):
    rng = np.random.default_rng(3)
    a = bits(rng.integers(-8, 9, (16, 16)).astype(np.float32), kind)
    bk = bits(rng.integers(-8, 9, (8, 16)).astype(np.float32), kind)
    bv = bits(rng.integers(-8, 9, (16, 8)).astype(np.float32), kind)
    c = rng.integers(-50, 51, (16, 8)).astype(np.float32)
    d_k = np.full((16, 8), np.nan, np.float32)
    d_v = np.full((16, 8), np.nan, np.float32)
    probe(f"pagedkv::ldmatrix_mma_probe<{TYPES[kind]}>").launch(
        (1, 1, 1), (32, 1, 1), [d_k, d_v, a, bk, bv, c]
    )
    assert np.array_equal(d_k, (values(a, kind) @ values(bk, kind).T + c).astype(np.float32))
    assert np.array_equal(d_v, (values(a, kind) @ values(bv, kind) + c).astype(np.float32))


def test_cp_async_groups_complete_in_order_and_poison_until_waited():
    src = np.arange(3 * 32 * 4, dtype=np.float32).reshape(3, 32, 4) + 1
    out = np.zeros((4, 32, 4), np.float32)
    probe("pagedkv::cp_async_probe").launch((1, 1, 1), (32, 1, 1), [out, src])
    assert np.array_equal(out[0], src[0])
    assert np.isnan(out[1]).all(), "a tile read before its wait_group must show as NaN"
    assert np.array_equal(out[2], src[1])
    assert np.array_equal(out[3], np.zeros((32, 4), np.float32)), "src-size 0 zero-fills"


@pytest.mark.parametrize("kind", list(TYPES))
def test_pack2_rounds_to_nearest_even(kind):
    rng = np.random.default_rng(4)
    x = np.concatenate([rng.standard_normal(60) * 100, [65520.0, 1e-8, -0.0, np.inf]]).astype(np.float32)
    out = np.zeros(32, np.uint32)
    probe(f"pagedkv::pack_probe<{TYPES[kind]}>").launch((1, 1, 1), (32, 1, 1), [out, x])
    b = bits(x, kind).astype(np.uint32)
    assert np.array_equal(out, b[0::2] | b[1::2] << 16)


def test_partial_warp_mma_is_refused():
    with pytest.raises(emulation.KernelLaunchError, match="all 32 lanes"):
        probe("pagedkv::partial_warp_mma_probe").launch((1, 1, 1), (16, 1, 1), [np.zeros(16, np.float32)])


def test_ldmatrix_outside_shared_memory_is_refused():
    with pytest.raises(emulation.KernelLaunchError, match="shared memory"):
        probe("pagedkv::ldmatrix_global_probe").launch((1, 1, 1), (32, 1, 1), [np.zeros((32, 4), np.uint32)])


def test_probes_compile_for_sm90_with_nvrtc():
    from pagedkv.kernels import nvrtc

    try:
        nvrtc.load()
    except nvrtc.NvrtcUnavailable:
        pytest.skip("libnvrtc not installed (pip install nvidia-cuda-nvrtc)")
    result = nvrtc.compile_source(PROBES, NAMES, source_dir=HERE)
    assert result.warnings() == []
    assert result.cubin_bytes > 0
