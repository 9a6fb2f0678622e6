"""``backend="cpu"`` on quantized caches (the Rust crate's ``quant`` module through
``cpu_quant_backend``).

- Writes are the NumPy reference's, byte for byte (block bytes and int4 residual slots), whatever
  the chunking, element type and value range (outlier channels, tiny and huge scales, NaN rows).
- Attention equals, bit for bit, the CPU data plane's unquantized kernel on an fp32 cache of the
  dequantized values (the same tile arithmetic over the same values), and the NumPy reference on
  the quantized cache within the CPU data plane's stated tolerance (docs/cpu_data_plane.md:
  fp32 2e-5, fp16 2^-10, bf16 2^-7, relative to the output's scale here, as these inputs are
  standard normal rather than in [-1, 1]).
- Copies and swaps move bytes as they are; bad arguments are refused before anything is written.
"""

from __future__ import annotations

import numpy as np
import pytest
from pagedkv.attention import (
    QuantizedKvCache,
    copy_blocks,
    paged_attention,
    paged_prefill_attention,
    swap_blocks,
    write_kv,
)
from pagedkv.attention.dtypes import from_compute, to_compute
from pagedkv.errors import InvalidArgumentError

from .quant_problems import dequantized_cache, empty_pair, make_problem, to_kind

DTYPES = ["int8", "fp8_e4m3", "int4"]
KINDS = ["float32", "float16", "bfloat16"]
TOLERANCE = {"float32": 2e-5, "float16": 2.0**-10, "bfloat16": 2.0**-7}


def _pair(seed, dtype, kind, lens, heads, dim, bs, backend, scale=1.0):
    return make_problem(seed, dtype, kind, lens, heads, dim, bs, backend=backend, scale=scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("bs", "heads", "dim", "scale"), [(16, 2, 64, 1.0), (8, 1, 128, 1e-3), (1, 3, 32, 300.0)]
)
def test_writes_are_the_reference_bytes(dtype, kind, bs, heads, dim, scale):
    lens = [0, 1, 17, 40, 33]
    ref = _pair(21, dtype, kind, lens, heads, dim, bs, "numpy", scale)
    cpu = _pair(21, dtype, kind, lens, heads, dim, bs, "cpu", scale)
    np.testing.assert_array_equal(cpu.k_cache.data, ref.k_cache.data)
    np.testing.assert_array_equal(cpu.v_cache.data, ref.v_cache.data)
    if dtype == "int4":
        # Residual slots (int8 blocks; poisoned bytes where never written): equal bytes.
        for a, b in (
            (cpu.k_cache.residual, ref.k_cache.residual),
            (cpu.v_cache.residual, ref.v_cache.residual),
        ):
            np.testing.assert_array_equal(a.data, b.data)


@pytest.mark.parametrize("dtype", DTYPES)
def test_writes_of_special_rows_are_the_reference_bytes(dtype):
    """A NaN or an infinity poisons its row (8-bit) or set (int4) the same way; an outlier
    channel, zeros, subnormal-sized rows, rows beyond the 8-bit scale's range (saturating) and
    rows whose maximum sits exactly on, or one float32 step above, a scale's reach (127 * s,
    448 * s) quantize the same way."""
    rng = np.random.default_rng(4)
    n, heads, dim, bs = 32, 2, 64, 16
    k = rng.standard_normal((n, heads, dim)).astype(np.float32)
    k[:, :, 5] = k[:, :, 5] * 40 + 17  # an outlier channel
    k[3, 0, 7] = np.nan
    k[20, 1, 0] = -np.inf
    k[9] = 0.0
    k[10] = 1e-39
    k[11, 0] = rng.standard_normal(dim) * 1e-30
    k[12, 0] = rng.standard_normal(dim) * 1e6  # beyond the largest scale: saturates
    k[13, :, 0] = np.float32(127 * 1.375 * 2.0**-3)  # exactly int8's reach of a UE5M3 scale
    k[14, :, 0] = np.nextafter(np.float32(448 * 1.625), np.float32(np.inf))  # just past e4m3's
    k[15, :, :2] = np.float32(1.125 * 2.0**-4) * np.float32([126.5, -0.5])  # codes' ties
    v = k[::-1].copy()
    slots = np.arange(n, dtype=np.int64)
    res = np.zeros(n, np.int32) if dtype == "int4" else None
    out = []
    for backend in ("numpy", "cpu"):
        kc, vc = empty_pair(dtype, "float32", 2, bs, heads, dim, 1)
        write_kv(k, v, kc, vc, slots, residual_slots=res, backend=backend)
        out.append((kc.data.copy(), vc.data.copy()))
    np.testing.assert_array_equal(out[1][0], out[0][0])
    np.testing.assert_array_equal(out[1][1], out[0][1])


def _query(seed, rows, heads, dim, kind):
    return to_kind(np.random.default_rng(seed).standard_normal((rows, heads, dim)), kind)


def _plain_cpu_on_dequantized(p, q, kind, call):
    """The CPU kernel on fp32 caches of the dequantized values, the output narrowed to q's dtype."""
    kd, vd = dequantized_cache(p)
    q32 = np.ascontiguousarray(to_compute(q, kind)).astype(np.float32)
    return from_compute(call(q32, kd, vd), kind, q.dtype)


def _close_to_reference(got, want, kind):
    g, w = to_compute(got, kind).astype(np.float64), to_compute(want, kind).astype(np.float64)
    scale = max(1.0, float(np.abs(w).max(initial=0.0)))
    np.testing.assert_allclose(g, w, rtol=0, atol=TOLERANCE[kind] * scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("kind", "bs", "heads", "group", "window"),
    [
        ("float32", 16, 2, 1, None),
        ("float16", 8, 1, 4, None),
        ("bfloat16", 16, 2, 3, 20),
        ("float32", 1, 1, 2, 7),
    ],
)
def test_decode(dtype, kind, bs, heads, group, window):
    lens = [0, 1, 37, 48, 15, 300]
    p = _pair(7, dtype, kind, lens, heads, 64, bs, "cpu")
    q = _query(8, len(lens), heads * group, 64, kind)
    args = (p.block_tables, p.seq_lens)
    out = paged_attention(
        q, p.k_cache, p.v_cache, *args, window=window, residual_slots=p.residual_slots, backend="cpu"
    )
    plain = _plain_cpu_on_dequantized(
        p, q, kind, lambda q32, kd, vd: paged_attention(q32, kd, vd, *args, window=window, backend="cpu")
    )
    np.testing.assert_array_equal(out.view(np.uint8), plain.view(np.uint8))
    ref = paged_attention(q, p.k_cache, p.v_cache, *args, window=window, residual_slots=p.residual_slots)
    _close_to_reference(out, ref, kind)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("causal", "window"), [(True, None), (True, 9), (False, None)])
@pytest.mark.parametrize("kind", ["float32", "float16"])
def test_prefill(dtype, causal, window, kind):
    lens, q_lens = [29, 40, 5, 16, 270], [11, 1, 5, 0, 40]
    p = _pair(11, dtype, kind, lens, 2, 64, 8, "cpu")
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = _query(12, int(qsl[-1]), 4, 64, kind)
    kw = {"causal": causal, "window": window}
    args = (p.block_tables, p.seq_lens, qsl)
    out = paged_prefill_attention(
        q, p.k_cache, p.v_cache, *args, residual_slots=p.residual_slots, backend="cpu", **kw
    )
    plain = _plain_cpu_on_dequantized(
        p, q, kind, lambda q32, kd, vd: paged_prefill_attention(q32, kd, vd, *args, backend="cpu", **kw)
    )
    np.testing.assert_array_equal(out.view(np.uint8), plain.view(np.uint8))
    ref = paged_prefill_attention(q, p.k_cache, p.v_cache, *args, residual_slots=p.residual_slots, **kw)
    _close_to_reference(out, ref, kind)


def test_an_open_block_is_read_from_its_residual_slot_only():
    """int4: poisoning every residual slot but the sequence's own changes nothing; poisoning its
    own makes the output NaN (so the slot is really read)."""
    p = _pair(3, "int4", "float32", [21, 16], 1, 64, 16, "cpu")
    q = _query(4, 2, 2, 64, "float32")
    kw = {"residual_slots": p.residual_slots, "backend": "cpu"}
    before = paged_attention(q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, **kw)
    res = p.k_cache.residual
    res.data[1] = 0xFF  # sequence 1's slot (NaN scales): its blocks are all sealed
    again = paged_attention(q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, **kw)
    np.testing.assert_array_equal(again, before)
    # Sequence 0's last token (offset 4 of its open block, one head): a NaN scale byte.
    res.data[0, res.layout.meta_offset + 4] = 0xFF
    poisoned = paged_attention(q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, **kw)
    assert np.isnan(poisoned[0]).all() and not np.isnan(poisoned[1]).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_and_swap_move_bytes_as_the_reference_does(dtype):
    p = _pair(9, dtype, "float16", [20, 33], 2, 64, 8, "cpu")
    q = _pair(9, dtype, "float16", [20, 33], 2, 64, 8, "numpy")
    ops = np.array([[int(p.block_tables[1, 1]), 7], [7, 6]], np.int32)
    copy_blocks([p.k_cache], [p.v_cache], ops, backend="cpu")
    copy_blocks([q.k_cache], [q.v_cache], ops)
    np.testing.assert_array_equal(p.k_cache.data, q.k_cache.data)
    np.testing.assert_array_equal(p.v_cache.data, q.v_cache.data)
    for role, src in (("key", p.k_cache), ("value", p.v_cache)):
        host = QuantizedKvCache.empty(dtype, role, 3, 8, 2, 64, num_residual_slots=1)
        mapping = np.array([[2, 0], [3, 1], [7, 2]], np.int32)
        assert swap_blocks(src, host, mapping, backend="cpu") == 2  # 2, 3 adjacent
        np.testing.assert_array_equal(host.data, src.data[[2, 3, 7]])
        with pytest.raises(InvalidArgumentError):
            swap_blocks(src, host, np.array([[0, 3]], np.int32), backend="cpu")  # no host block 3


def test_mismatched_caches_are_refused():
    kc, vc = empty_pair("int8", "float32", 4, 8, 1, 64, 0)
    k4, v4 = empty_pair("int4", "float16", 4, 8, 1, 64, 2)
    q = np.zeros((1, 1, 64), np.float32)
    tables, lens = np.array([[0]], np.int32), np.array([3], np.int32)
    with pytest.raises(InvalidArgumentError, match="role"):
        paged_attention(q, vc, kc, tables, lens, backend="cpu")
    with pytest.raises(InvalidArgumentError):
        paged_attention(q, kc, v4, tables, lens, backend="cpu")
    with pytest.raises(InvalidArgumentError, match="residual_slots"):
        paged_attention(q, kc, vc, tables, lens, residual_slots=np.zeros(1, np.int32), backend="cpu")
    with pytest.raises(InvalidArgumentError, match="residual"):
        paged_attention(q, k4, v4, tables, lens, backend="cpu")  # int4, open block, no slots
    # The residual slots are int8 blocks: rows of another length are refused.
    short = QuantizedKvCache(
        k4.data,
        "int4",
        "key",
        8,
        1,
        64,
        QuantizedKvCache(np.zeros((2, 512), np.uint8), "int8", "key", 8, 1, 64),
    )
    with pytest.raises(InvalidArgumentError, match="residual"):
        paged_attention(q, short, v4, tables, lens, residual_slots=np.zeros(1, np.int32), backend="cpu")
    k = np.ones((3, 1, 64), np.float32)
    with pytest.raises(InvalidArgumentError, match="residual"):
        write_kv(
            k, k, short, v4, np.arange(3, dtype=np.int64), residual_slots=np.zeros(3, np.int32), backend="cpu"
        )
    with pytest.raises(InvalidArgumentError):  # one array as both caches
        write_kv(k, k, kc, kc, np.arange(3, dtype=np.int64), backend="cpu")
    bad = QuantizedKvCache(
        kc.data.reshape(-1)[: 4 * 512].reshape(4, 512), "int8", "key", 8, 1, 64
    )  # not 528-byte rows
    with pytest.raises(InvalidArgumentError):
        paged_attention(q, bad, vc, tables, lens, backend="cpu")


def test_a_refused_copy_copies_nothing():
    """Keys and values go to Rust in one call: a value cache refused (here: fewer blocks than the
    copy names) leaves the key cache as it was, never the keys copied and the values refused."""
    k = QuantizedKvCache.empty("int4", "key", 4, 8, 1, 64, num_residual_slots=1)
    v = QuantizedKvCache.empty("int4", "value", 2, 8, 1, 64, num_residual_slots=1)
    k.data[0] = 7
    with pytest.raises(InvalidArgumentError):
        copy_blocks([k], [v], np.array([[0, 3]], np.int32), backend="cpu")
    assert not k.data[1:].any()


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_residual_slots_move_with_swap_and_fork_copies(backend):
    """int4's residual slots are int8 caches: a swap out and back into another slot (the engine's
    swap preemption) and a fork's copy move their bytes as they are, so each sequence attends
    exactly as before from its new slot, on both backends."""
    p = _pair(12, "int4", "float16", [21, 13], 2, 64, 8, backend)
    q = _query(13, 2, 4, 64, "float16")
    args = (p.block_tables, p.seq_lens)
    kw = {"backend": backend}
    before = paged_attention(q, p.k_cache, p.v_cache, *args, residual_slots=p.residual_slots, **kw)
    hosts = [QuantizedKvCache.empty("int8", c.role, 2, 8, 2, 64) for c in (p.k_cache, p.v_cache)]
    for cache, host in zip((p.k_cache, p.v_cache), hosts, strict=True):
        swap_blocks(cache.residual, host, np.array([[0, 1], [1, 0]], np.int32), **kw)  # out
        cache.residual.data[...] = 0xFF  # the device slots reused by others meanwhile (NaN)
        swap_blocks(host, cache.residual, np.array([[1, 1], [0, 0]], np.int32), **kw)  # back, swapped
    swapped = paged_attention(q, p.k_cache, p.v_cache, *args, residual_slots=np.array([1, 0], np.int32), **kw)
    np.testing.assert_array_equal(swapped, before)
    # A fork: sequence 0's slot (now 1) copied into slot 0; both read the same open block.
    copy_blocks([p.k_cache.residual], [p.v_cache.residual], np.array([[1, 0]], np.int32), **kw)
    np.testing.assert_array_equal(p.k_cache.residual.data[0], p.k_cache.residual.data[1])
    forked = paged_attention(
        q[:1],
        p.k_cache,
        p.v_cache,
        p.block_tables[:1],
        p.seq_lens[:1],
        residual_slots=np.array([0], np.int32),
        **kw,
    )
    np.testing.assert_array_equal(forked, before[:1])
