"""The quantized-cache CUDA kernels, run on the CPU through the emulation harness, against the
NumPy reference.

Writes (8-bit quantization, int4 seals, residual parking) must produce the reference's bytes bit
for bit: the codec's arithmetic is fixed-order float32 with exact products. Attention accumulates
in another order than the reference, so it is compared within the kernel tests' tolerance
(``tests/kernels/conftest.py``: 2e-5 fp32, 2e-3 fp16, 1.6e-2 bf16, relative and absolute).
Every case covers one (dtype, element type, head size) instance; block sizes, GQA groups,
windows, splits and chunked writes vary across them. Shapes stay small: each CUDA block's threads
are real threads."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from pagedkv.attention import copy_blocks, paged_attention, paged_prefill_attention, swap_blocks, write_kv
from pagedkv.kernels import emulation, instances

from .quant_problems import empty_pair, make_problem, to_kind

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="backend='emulated' needs g++")
# Kernel output vs the reference, as tests/kernels/conftest.py states it for the unquantized kernels.
TOLERANCE = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}

# (kv_cache_dtype, element kind, head_dim, block_size, kv heads, group, seq_lens, window)
CASES = [
    ("int8", "float32", 64, 16, 2, 1, [37, 1, 16], None),
    ("int8", "bfloat16", 256, 8, 1, 3, [19, 9], 11),
    ("fp8_e4m3", "float16", 64, 32, 1, 8, [45, 3], None),
    ("fp8_e4m3", "float32", 128, 1, 2, 2, [13, 6], 4),
    ("int4", "float16", 64, 16, 2, 4, [40, 16, 5], None),
    ("int4", "bfloat16", 128, 8, 1, 3, [27, 12], 9),
    ("int4", "float32", 256, 32, 1, 2, [35, 4], None),
]
IDS = [f"{c[0]}-{c[1]}-d{c[2]}-bs{c[3]}" for c in CASES]


def _instances() -> list[tuple[str, str]]:
    out = []
    for dtype, kind, dim, *_ in CASES:
        out += [instances.quant_attention(dtype, kind, dim), instances.merge(kind, dim)]
        if dtype == "int4":
            out += [instances.seal_int4(kind, dim), instances.write_kv(kind, dim)]
        else:
            out.append(instances.quantize_kv(dtype, kind, dim))
    out.append(instances.copy_blocks())
    return [(i.source, i.name) for i in dict.fromkeys(out)]


@pytest.fixture(scope="module", autouse=True)
def built():
    emulation.prebuild(_instances())


def _pair(case, backend):
    dtype, kind, dim, bs, heads, _, lens, _ = case
    return make_problem(
        IDS.index(f"{dtype}-{kind}-d{dim}-bs{bs}"), dtype, kind, lens, heads, dim, bs, backend
    )


def _close(actual, expected, kind):
    from pagedkv.attention.dtypes import to_compute

    a, e = to_compute(actual, kind).astype(np.float64), to_compute(expected, kind).astype(np.float64)
    assert not np.isnan(a).any(), "kernel output holds NaN (a stray read of a poisoned slot?)"
    np.testing.assert_allclose(a, e, rtol=TOLERANCE[kind], atol=TOLERANCE[kind])


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_writes_match_the_reference_bit_for_bit(case):
    ref, emu = _pair(case, "numpy"), _pair(case, "emulated")
    for a, b in ((ref.k_cache, emu.k_cache), (ref.v_cache, emu.v_cache)):
        np.testing.assert_array_equal(a.data, b.data)  # poisoned unused blocks untouched alike
        if a.residual is not None:  # the int8 residual slots, poisoned rows untouched alike
            np.testing.assert_array_equal(a.residual.data, b.residual.data)


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_the_reference(case, num_splits):
    dtype, kind, dim, bs, heads, group, lens, window = case
    p = _pair(case, "numpy")
    q = to_kind(np.random.default_rng(num_splits).standard_normal((len(lens), heads * group, dim)), kind)
    args = (q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens)
    expected = paged_attention(*args, window=window, residual_slots=p.residual_slots)
    out = paged_attention(
        *args, window=window, residual_slots=p.residual_slots, backend="emulated", num_splits=num_splits
    )
    assert out.dtype == q.dtype and out.shape == q.shape
    _close(out, expected, kind)


@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[5]], ids=[IDS[0], IDS[3], IDS[5]])
@pytest.mark.parametrize(("causal", "num_splits"), [(True, None), (True, 2), (False, None)])
def test_prefill_matches_the_reference(case, causal, num_splits):
    dtype, kind, dim, bs, heads, group, lens, window = case
    p = _pair(case, "numpy")
    q_lens = [min(n, 1 + 5 * i) for i, n in enumerate(lens)]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = to_kind(np.random.default_rng(4).standard_normal((int(qsl[-1]), heads * group, dim)), kind)
    w = window if causal else None
    args = (q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, qsl)
    expected = paged_prefill_attention(*args, causal=causal, window=w, residual_slots=p.residual_slots)
    out = paged_prefill_attention(
        *args,
        causal=causal,
        window=w,
        residual_slots=p.residual_slots,
        backend="emulated",
        num_splits=num_splits,
    )
    _close(out, expected, kind)


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[4]], ids=[IDS[0], IDS[2], IDS[4]])
def test_nan_infinity_and_edge_rows_are_quantized_as_the_reference_does(case):
    dtype, kind, dim, bs, heads, *_ = case
    rng = np.random.default_rng(0)
    k = to_kind(rng.standard_normal((bs + 3, heads, dim)), kind)
    k[1, 0, 3] = np.nan
    k[bs + 1, -1, 0] = np.inf
    k[2, 0] = to_kind(rng.standard_normal(dim) * 6e4, kind)  # beyond int8's largest scale: saturates
    k[3, :, 0] = to_kind(np.full(heads, 127 * 1.375 * 2.0**-3), kind)  # exactly int8's reach of a scale
    k[4, :, :2] = to_kind(np.array([126.5, -0.5]) * 1.125 * 2.0**-4, kind)  # ties of int8 codes
    results = []
    for backend in ("numpy", "emulated"):
        kc, vc = empty_pair(dtype, kind, 3, bs, heads, dim, 1)
        res = np.zeros(bs + 3, np.int32) if dtype == "int4" else None
        write_kv(k, k, kc, vc, np.arange(bs + 3, dtype=np.int64), backend=backend, residual_slots=res)
        results.append(kc.data.copy())
    np.testing.assert_array_equal(results[0], results[1])


@pytest.mark.parametrize("case", [CASES[1], CASES[4]], ids=[IDS[1], IDS[4]])
def test_copy_and_swap_move_the_same_bytes_as_the_reference(case):
    outs = []
    for backend in ("numpy", "emulated"):
        p = _pair(case, "numpy")
        q = _pair(case, "numpy")
        ops = np.array([[int(p.block_tables[0, 0]), int(p.block_tables[-1, 0])], [1, 0]], np.int32)
        copy_blocks([p.k_cache, q.k_cache], [p.v_cache, q.v_cache], ops, backend=backend)
        dst = empty_pair(case[0], case[1], 5, case[3], case[4], case[2], 1)[0]
        assert swap_blocks(p.k_cache, dst, np.array([[0, 2], [1, 3]], np.int32), backend=backend) == 1
        outs.append([c.data.copy() for c in (p.k_cache, p.v_cache, q.k_cache, q.v_cache, dst)])
    for a, b in zip(*outs, strict=True):
        np.testing.assert_array_equal(a, b)


def test_decode_workspace_refuses_quantized_caches():
    from pagedkv.attention import DecodeWorkspace
    from pagedkv.errors import InvalidArgumentError

    p = _pair(CASES[0], "numpy")
    ws = DecodeWorkspace(
        num_blocks=p.k_cache.num_blocks,
        block_size=16,
        num_kv_heads=2,
        num_q_heads=2,
        head_dim=64,
        dtype=np.float32,
        max_num_seqs=3,
        max_blocks_per_seq=int(p.block_tables.shape[1]),
        backend="emulated",
    )
    ws.plan(p.block_tables, p.seq_lens)
    q = np.zeros((3, 2, 64), np.float32)
    with pytest.raises(InvalidArgumentError, match="quantized"):
        ws.run(q, p.k_cache, p.v_cache)


@pytest.mark.parametrize("case", [CASES[2], CASES[4]], ids=[IDS[2], IDS[4]])
def test_the_cuda_backend_path_runs_the_same_launches_without_a_sync(monkeypatch, case):
    """backend='cuda' on a CuPy stand-in whose arrays refuse every device-to-host read
    (tests/kernels/fake_cupy.py), the kernels running in the emulation: the launcher's uploads
    and arguments are the GPU's, host metadata costs no sync, and the results equal the
    reference's (bytes) and the emulated backend's (attention)."""
    from kernels import fake_cupy
    from pagedkv.attention import QuantizedKvCache, runners

    monkeypatch.setattr(runners, "_cuda", fake_cupy.FakeCudaRunner())
    dtype, kind, dim, bs, heads, group, lens, window = case
    ref = _pair(case, "numpy")
    host_k, host_v = empty_pair(dtype, kind, ref.k_cache.num_blocks, bs, heads, dim, len(lens))
    dev = []
    for c in (host_k, host_v):
        data = fake_cupy.to_device(c.data)[0]
        residual = None
        if c.residual is not None:
            r = c.residual
            rdata = fake_cupy.to_device(r.data)[0]
            residual = QuantizedKvCache(rdata, r.kv_cache_dtype, r.role, bs, heads, dim)
        dev.append(QuantizedKvCache(data, dtype, c.role, bs, heads, dim, residual))
    for b, n in enumerate(lens):  # whole sequences, one write each, on both
        pos = np.arange(n)
        slots = ref.block_tables[b][pos // bs].astype(np.int64) * bs + pos % bs
        res = np.full(n, b, np.int32) if dtype == "int4" else None
        write_kv(ref.keys[b], ref.values[b], host_k, host_v, slots, residual_slots=res)
        k, v = fake_cupy.to_device(ref.keys[b], ref.values[b])
        write_kv(k, v, dev[0], dev[1], slots, backend="cuda", residual_slots=res)
    for a, b in ((host_k, dev[0]), (host_v, dev[1])):
        np.testing.assert_array_equal(fake_cupy.to_host(b.data), a.data)
    q = to_kind(np.random.default_rng(2).standard_normal((len(lens), heads * group, dim)), kind)
    fake_cupy.Counters.reset()
    out = paged_attention(
        fake_cupy.to_device(q)[0],
        dev[0],
        dev[1],
        ref.block_tables,
        ref.seq_lens,
        window=window,
        residual_slots=ref.residual_slots,
        backend="cuda",
        num_splits=2,
    )
    assert fake_cupy.Counters.launches == 2  # the quantized kernel and the merge
    emulated = paged_attention(
        q,
        host_k,
        host_v,
        ref.block_tables,
        ref.seq_lens,
        window=window,
        residual_slots=ref.residual_slots,
        backend="emulated",
        num_splits=2,
    )
    _close(fake_cupy.to_host(out), emulated, kind)
