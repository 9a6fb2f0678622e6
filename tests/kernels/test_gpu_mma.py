"""The tensor-core probes (harness_mma.cu) on a real GPU: the hardware's fragment layouts must be
the ones the CPU emulation implements (skipped without CuPy and a GPU)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pagedkv.kernels import KERNEL_DIR

from .conftest import cupy_and_gpu_marks
from .test_emulated_mma import NAMES, PROBES, TYPES, bits, values

cupy, pytestmark = cupy_and_gpu_marks("needs CuPy")
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def module():
    code = (HERE / PROBES).read_text()
    return cupy.RawModule(
        code=code, options=("-std=c++17", f"-I{KERNEL_DIR}", f"-I{HERE}"), name_expressions=NAMES
    )


def run(module, name, *arrays):
    dev = [cupy.asarray(a) for a in arrays]
    module.get_function(name)((1,), (32,), tuple(dev))
    return [d.get() for d in dev]


@pytest.mark.parametrize("kind", list(TYPES))
def test_mma_fragments_on_hardware(module, kind):
    rng = np.random.default_rng(1)
    a = bits(rng.integers(-8, 9, (16, 16)).astype(np.float32), kind)
    bt = bits(rng.integers(-8, 9, (8, 16)).astype(np.float32), kind)
    c = rng.integers(-100, 101, (16, 8)).astype(np.float32)
    d = np.full((16, 8), np.nan, np.float32)
    d, *_ = run(module, f"pagedkv::mma_fragment_probe<{TYPES[kind]}>", d, a, bt, c)
    assert np.array_equal(d, (values(a, kind) @ values(bt, kind).T + c).astype(np.float32))


def test_ldmatrix_on_hardware(module):
    m = np.arange(4 * 8 * 8, dtype=np.uint16).reshape(4, 8, 8)
    out, _ = run(module, "pagedkv::ldmatrix_probe", np.zeros((32, 8), np.uint32), m)
    lane = np.arange(32)
    for j in range(4):
        lo = m[j, lane // 4, 2 * (lane % 4)].astype(np.uint32)
        hi = m[j, lane // 4, 2 * (lane % 4) + 1].astype(np.uint32)
        assert np.array_equal(out[:, j], lo | hi << 16)
        lo = m[j, 2 * (lane % 4), lane // 4].astype(np.uint32)
        hi = m[j, 2 * (lane % 4) + 1, lane // 4].astype(np.uint32)
        assert np.array_equal(out[:, 4 + j], lo | hi << 16)


@pytest.mark.parametrize("kind", list(TYPES))
def test_ldmatrix_mma_on_hardware(module, kind):
    rng = np.random.default_rng(3)
    a = bits(rng.integers(-8, 9, (16, 16)).astype(np.float32), kind)
    bk = bits(rng.integers(-8, 9, (8, 16)).astype(np.float32), kind)
    bv = bits(rng.integers(-8, 9, (16, 8)).astype(np.float32), kind)
    c = rng.integers(-50, 51, (16, 8)).astype(np.float32)
    z = np.zeros((16, 8), np.float32)
    d_k, d_v, *_ = run(module, f"pagedkv::ldmatrix_mma_probe<{TYPES[kind]}>", z, z.copy(), a, bk, bv, c)
    assert np.array_equal(d_k, (values(a, kind) @ values(bk, kind).T + c).astype(np.float32))
    assert np.array_equal(d_v, (values(a, kind) @ values(bv, kind) + c).astype(np.float32))


def test_cp_async_on_hardware(module):
    src = np.arange(3 * 32 * 4, dtype=np.float32).reshape(3, 32, 4) + 1
    out, _ = run(module, "pagedkv::cp_async_probe", np.zeros((4, 32, 4), np.float32), src)
    assert np.array_equal(out[0], src[0]) and np.array_equal(out[2], src[1])
    assert np.array_equal(out[3], np.zeros((32, 4), np.float32))


@pytest.mark.parametrize("kind", list(TYPES))
def test_pack2_on_hardware(module, kind):
    rng = np.random.default_rng(4)
    x = np.concatenate([rng.standard_normal(60) * 100, [65520.0, 1e-8, -0.0, np.inf]]).astype(np.float32)
    out, _ = run(module, f"pagedkv::pack_probe<{TYPES[kind]}>", np.zeros(32, np.uint32), x)
    b = bits(x, kind).astype(np.uint32)
    assert np.array_equal(out, b[0::2] | b[1::2] << 16)
