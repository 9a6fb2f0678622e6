"""The quantized-cache kernels on a real GPU (backend='cuda') against the NumPy reference:
every (dtype, element type, head size) instance writes the reference's bytes and attends within
the kernel tolerance (skipped without CuPy and a GPU; ``pytest -m gpu tests/quant``)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from pagedkv.attention import QuantizedKvCache, paged_attention, paged_prefill_attention, write_kv
from pagedkv.kernels import instances

from .quant_problems import make_problem, to_kind

cupy = pytest.importorskip("cupy", reason="backend='cuda' needs CuPy")
try:
    _DEVICES = int(cupy.cuda.runtime.getDeviceCount())
except Exception:  # CuPy without a driver raises its own runtime errors here
    _DEVICES = 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_DEVICES == 0, reason="no CUDA GPU")]

TOLERANCE = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}
GRID = list(itertools.product(instances.QUANT_FORMATS, instances.KERNEL_TYPES, instances.HEAD_DIMS, (1, 16)))


def _device_pair(p):
    out = []
    for c in (p.k_cache, p.v_cache):
        residual = None
        if c.residual is not None:  # int8 slots, poisoned: 0xFF scales read as NaN
            r = c.residual
            rdata = cupy.asarray(np.full_like(r.data, 0xFF))
            residual = QuantizedKvCache(
                rdata, r.kv_cache_dtype, r.role, r.block_size, r.num_kv_heads, r.head_dim
            )
        data = cupy.asarray(np.full_like(c.data, 0xFF))
        out.append(
            QuantizedKvCache(
                data, c.kv_cache_dtype, c.role, c.block_size, c.num_kv_heads, c.head_dim, residual
            )
        )
    return out


def _close(actual, expected, kind):
    from pagedkv.attention.dtypes import to_compute

    a = to_compute(actual, kind).astype(np.float64)
    e = to_compute(expected, kind).astype(np.float64)
    assert not np.isnan(a).any()
    np.testing.assert_allclose(a, e, rtol=TOLERANCE[kind], atol=TOLERANCE[kind])


@pytest.mark.parametrize("dtype,kind,head_dim,block_size", GRID)
def test_every_instance_writes_and_attends_as_the_reference(dtype, kind, head_dim, block_size):
    lens = [1, 70, 16 * block_size + 3]
    p = make_problem(len(lens), dtype, kind, lens, 2, head_dim, block_size)
    dk, dv = _device_pair(p)
    for b, n in enumerate(lens):  # whole sequences, one write each (the reference wrote in chunks)
        pos = np.arange(n)
        slots = p.block_tables[b][pos // block_size].astype(np.int64) * block_size + pos % block_size
        res = np.full(n, b, np.int32) if dtype == "int4" else None
        write_kv(
            cupy.asarray(p.keys[b]),
            cupy.asarray(p.values[b]),
            dk,
            dv,
            slots,
            backend="cuda",
            residual_slots=res,
        )
    for ref, dev in ((p.k_cache, dk), (p.v_cache, dv)):  # bytes as the reference's (written in chunks)
        np.testing.assert_array_equal(cupy.asnumpy(dev.data), ref.data)
        if ref.residual is not None:  # the open blocks' tokens (rows past them are stale or unused)
            got, want, rl = cupy.asnumpy(dev.residual.data), ref.residual.data, ref.residual.layout
            for b, n in enumerate(lens):
                rows = n % block_size * rl.num_kv_heads
                np.testing.assert_array_equal(got[b, : rows * rl.head_dim], want[b, : rows * rl.head_dim])
                meta = slice(rl.meta_offset, rl.meta_offset + rows)
                np.testing.assert_array_equal(got[b, meta], want[b, meta])
    q = to_kind(np.random.default_rng(0).standard_normal((len(lens), 8, head_dim)), kind)
    expected = paged_attention(
        q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, residual_slots=p.residual_slots
    )
    for splits in (None, 3):
        out = paged_attention(
            cupy.asarray(q),
            dk,
            dv,
            p.block_tables,
            p.seq_lens,
            residual_slots=p.residual_slots,
            backend="cuda",
            num_splits=splits,
        )
        _close(cupy.asnumpy(out), expected, kind)
    qsl = np.array([0, 1, 30, 30 + lens[2]], np.int32)
    qp = to_kind(np.random.default_rng(1).standard_normal((int(qsl[-1]), 4, head_dim)), kind)
    expected = paged_prefill_attention(
        qp, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, qsl, residual_slots=p.residual_slots, window=40
    )
    out = paged_prefill_attention(
        cupy.asarray(qp),
        dk,
        dv,
        p.block_tables,
        p.seq_lens,
        qsl,
        residual_slots=p.residual_slots,
        window=40,
        backend="cuda",
    )
    _close(cupy.asnumpy(out), expected, kind)
