"""The NumPy reference on quantized caches (``backend="numpy"``).

Attention on a quantized cache is, bit for bit, the unquantized reference's attention on an fp32
cache holding the dequantized values (quant_reference gathers them and runs the same ``attend``):
so the only error a quantized cache adds is the codec's, bounded in test_codec.py. Against the
original fp32 keys and values, the error is within a stated tolerance (standard-normal data,
relative to the output's largest magnitude): int8 0.04, fp8_e4m3 0.12, int4 0.3 (measured maxima
over these cases: about a third of each)."""

from __future__ import annotations

import numpy as np
import pytest
from pagedkv.attention import (
    QuantizedKvCache,
    contiguous_attention,
    copy_blocks,
    paged_attention,
    paged_prefill_attention,
    swap_blocks,
    write_kv,
)
from pagedkv.attention.dtypes import from_compute, to_compute
from pagedkv.attention.quant_codec import decode_blocks, encode_blocks, round_trip_8bit
from pagedkv.errors import InvalidArgumentError

from .quant_problems import (
    KIND_DTYPES,
    dequantized_cache,
    dequantized_history,
    empty_pair,
    make_problem,
    to_kind,
)

DTYPES = ["int8", "fp8_e4m3", "int4"]
VS_ORIGINAL = {"int8": 0.04, "fp8_e4m3": 0.12, "int4": 0.3}


def _query(seed: int, rows: int, heads: int, dim: int, kind: str) -> np.ndarray:
    return to_kind(np.random.default_rng(seed).standard_normal((rows, heads, dim)), kind)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("kind", "block_size", "heads", "group", "window"),
    [
        ("float32", 16, 2, 1, None),
        ("float16", 8, 1, 4, None),
        ("bfloat16", 16, 2, 3, 20),
        ("float32", 1, 1, 2, 7),
    ],
)
def test_decode_equals_the_reference_on_the_dequantized_cache(dtype, kind, block_size, heads, group, window):
    lens = [0, 1, 37, 48, 15]
    p = make_problem(7, dtype, kind, lens, heads, 64, block_size)
    q = _query(8, len(lens), heads * group, 64, kind)
    out = paged_attention(
        q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, window=window, residual_slots=p.residual_slots
    )
    kd, vd = dequantized_cache(p)
    q32 = np.ascontiguousarray(to_compute(q, kind))
    expected = paged_attention(q32, kd, vd, p.block_tables, p.seq_lens, window=window)
    np.testing.assert_array_equal(out, from_compute(expected, kind, q.dtype))
    # and against the original keys and values
    for b, n in enumerate(lens):
        lo = 0 if window is None else max(0, n - window)
        k = to_compute(p.keys[b], kind)[lo:]
        v = to_compute(p.values[b], kind)[lo:]
        exact = contiguous_attention(q32[b], k, v)
        scale = max(1.0, float(np.abs(exact).max()))
        assert float(np.abs(to_compute(out[b], kind) - exact).max()) <= VS_ORIGINAL[dtype] * scale


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("causal", "window"), [(True, None), (True, 9), (False, None)])
def test_prefill_equals_the_reference_on_the_dequantized_cache(dtype, causal, window):
    lens, q_lens = [29, 40, 5, 16], [11, 1, 5, 0]
    p = make_problem(11, dtype, "float32", lens, 2, 64, 8)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = _query(12, int(qsl[-1]), 4, 64, "float32")
    out = paged_prefill_attention(
        q,
        p.k_cache,
        p.v_cache,
        p.block_tables,
        p.seq_lens,
        qsl,
        causal=causal,
        window=window,
        residual_slots=p.residual_slots,
    )
    kd, vd = dequantized_cache(p)
    expected = paged_prefill_attention(
        q, kd, vd, p.block_tables, p.seq_lens, qsl, causal=causal, window=window
    )
    np.testing.assert_array_equal(out, expected)


def test_a_sequence_whose_last_block_is_full_needs_no_residual_slot():
    p = make_problem(3, "int4", "float32", [32, 16], 1, 64, 16)
    q = _query(4, 2, 2, 64, "float32")
    expected = paged_attention(
        q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, residual_slots=p.residual_slots
    )
    p.k_cache.residual.data[...] = 0xFF  # NaN scales, never read: every block is sealed
    out = paged_attention(
        q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, residual_slots=np.array([-1, -1], np.int32)
    )
    np.testing.assert_array_equal(out, expected)


def test_writes_seal_a_block_when_it_fills_whatever_the_chunking():
    """One write of a whole sequence and the same sequence in every chunking give the same bytes:
    a seal quantizes its tokens' int8 values whether they were parked in the residual slot or
    arrive with the sealing write (docs/quantized_kv.md, "The residual in a paged cache")."""
    rng = np.random.default_rng(5)
    k = rng.standard_normal((37, 2, 64)).astype(np.float32)
    v = rng.standard_normal((37, 2, 64)).astype(np.float32)
    results = []
    for cuts in ([], [5, 16, 17, 31], list(range(1, 37))):
        kc, vc = empty_pair("int4", "float32", 4, 16, 2, 64, 1)
        bounds = [0, *cuts, 37]
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            slots = np.arange(lo, hi, dtype=np.int64) + 16  # blocks 1, 2, 3
            write_kv(k[lo:hi], v[lo:hi], kc, vc, slots, residual_slots=np.zeros(hi - lo, np.int32))
        open_rows = decode_blocks(kc.residual.data[:1], kc.residual.layout)[0, :5]
        results.append((kc.data.copy(), vc.data.copy(), open_rows))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            np.testing.assert_array_equal(a, b)
    # The open block's tokens: their int8 values (each row with its own UE5M3 scale).
    np.testing.assert_array_equal(results[0][2], round_trip_8bit(k[32:], "int8"))
    # A sealed block: int4 of its tokens' int8 values.
    kc = empty_pair("int4", "float32", 4, 16, 2, 64, 1)[0]
    sealed = encode_blocks(round_trip_8bit(k[:32], "int8").reshape(2, 16, 2, 64), kc.layout)
    np.testing.assert_array_equal(results[0][0][1:3], sealed)


def _write_args(dtype: str):
    kc, vc = empty_pair(dtype, "float32", 4, 8, 1, 64, 2)
    k = np.ones((3, 1, 64), np.float32)
    res = np.zeros(3, np.int32) if dtype == "int4" else None
    return k, kc, vc, res


@pytest.mark.parametrize(
    ("dtype", "slots", "residual", "message"),
    [
        ("int4", [0, 1, 2], None, "residual_slots"),
        ("int4", [0, 1, 2], [-1, -1, -1], "residual slot"),
        ("int4", [0, 1, 2], [0, 0, 5], "different residual slots"),
        ("int4", [0, 2, 3], [0, 0, 0], "consecutive"),
        ("int4", [0, 8, 16], [0, 0, 0], "one residual slot"),
        ("int4", [0, 1, 2], [0, 0, 2], "different residual slots"),
        ("int8", [0, 1, 2], [0, 0, 0], "int4"),
        ("int8", [0, 0, 1], None, "twice"),
        ("int8", [0, 1, 32], None, "slot_mapping"),
    ],
)
@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_a_bad_write_is_refused_and_changes_nothing(dtype, slots, residual, message, backend):
    k, kc, vc, _ = _write_args(dtype)
    before = (kc.data.copy(), vc.data.copy())
    res = None if residual is None else np.array(residual, np.int32)
    with pytest.raises(InvalidArgumentError, match=message):
        write_kv(k, k, kc, vc, np.array(slots, np.int64), residual_slots=res, backend=backend)
    np.testing.assert_array_equal(kc.data, before[0])
    np.testing.assert_array_equal(vc.data, before[1])


def test_mismatched_caches_and_dtypes_are_refused():
    k, kc, vc, res = _write_args("int4")
    slots = np.arange(3, dtype=np.int64)
    with pytest.raises(InvalidArgumentError, match="role"):
        write_kv(k, k, vc, kc, slots, residual_slots=res)
    # The residual is an int8 cache of the same role and geometry, as many slots for K and V;
    # any float dtype may be written into it.
    with pytest.raises(InvalidArgumentError, match="residual"):
        QuantizedKvCache(kc.data, "int4", "key", 8, 1, 64, np.zeros((2, 8, 1, 64), np.float16))
    for bad in (("int8", "value", 8), ("fp8_e4m3", "key", 8), ("int8", "key", 4)):
        other = QuantizedKvCache.empty(bad[0], bad[1], 2, bad[2], 1, 64)
        with pytest.raises(InvalidArgumentError, match="residual"):
            QuantizedKvCache(kc.data, "int4", "key", 8, 1, 64, other)
    one_slot = QuantizedKvCache(
        kc.data, "int4", "key", 8, 1, 64, QuantizedKvCache.empty("int8", "key", 1, 8, 1, 64)
    )
    with pytest.raises(InvalidArgumentError, match="residual slots"):
        write_kv(k, k, one_slot, vc, slots, residual_slots=res)
    write_kv(k.astype(np.float16), k.astype(np.float16), kc, vc, slots, residual_slots=res)
    k8, kc8, vc8, _ = _write_args("int8")
    with pytest.raises(InvalidArgumentError, match="kv_cache_dtype"):
        write_kv(k, k, kc, vc8, slots, residual_slots=res)
    with pytest.raises(InvalidArgumentError, match="QuantizedKvCache"):
        write_kv(k, k, kc8, np.zeros((4, 8, 1, 64), np.float32), slots)
    with pytest.raises(InvalidArgumentError, match="int4 caches"):
        write_kv(
            k,
            k,
            np.zeros((4, 8, 1, 64), np.float32),
            np.zeros((4, 8, 1, 64), np.float32),
            slots,
            residual_slots=res,
        )
    q = np.zeros((1, 1, 64), np.float32)
    tables, lens = np.array([[0]], np.int32), np.array([3], np.int32)
    with pytest.raises(InvalidArgumentError, match="residual_slots"):
        paged_attention(q, kc, vc, tables, lens)  # the open block's slot is missing
    with pytest.raises(InvalidArgumentError, match="use_tensor_cores"):
        paged_attention(q, kc8, vc8, tables, lens, use_tensor_cores=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_and_swap_move_codes_and_scales_as_they_are(dtype):
    p = make_problem(9, dtype, "float16", [20, 33], 2, 64, 8, spare_blocks=4)
    layers_k = [p.k_cache, make_problem(10, dtype, "float16", [20, 33], 2, 64, 8, spare_blocks=4).k_cache]
    layers_v = [p.v_cache, make_problem(10, dtype, "float16", [20, 33], 2, 64, 8, spare_blocks=4).v_cache]
    src = int(p.block_tables[1, 1])
    free = sorted(set(range(p.k_cache.num_blocks)) - set(p.block_tables[p.block_tables >= 0].tolist()))
    ops = np.array([[src, free[0]]], np.int32)
    copy_blocks(layers_k, layers_v, ops)
    for c in (*layers_k, *layers_v):
        np.testing.assert_array_equal(c.data[free[0]], c.data[src])
    host_k = QuantizedKvCache.empty(dtype, "key", 6, 8, 2, 64, num_residual_slots=2)
    mapping = np.array([[src, 3], [free[0], 4]], np.int32)
    assert swap_blocks(p.k_cache, host_k, mapping) == 2  # (src, 3) and (free, 4) are separate runs
    np.testing.assert_array_equal(host_k.data[3], p.k_cache.data[src])
    np.testing.assert_array_equal(host_k.data[4], p.k_cache.data[src])
    with pytest.raises(InvalidArgumentError, match="role"):
        swap_blocks(p.k_cache, p.v_cache, mapping)


def test_a_fork_copies_the_residual_slot_and_the_copy_on_write_block():
    """The engine's protocol for an int4 fork (docs/quantized_kv.md, "The residual"): the child
    gets a residual slot holding a copy of the parent's; the manager's copy-on-write op copies
    the shared open block (its bytes are not yet meaningful); each then writes on its own."""
    import pagedkv

    kv = pagedkv.KvCacheManager(num_blocks=8, block_size=16)
    rng = np.random.default_rng(2)
    kc, vc = empty_pair("int4", "float32", 8, 16, 1, 64, 2)
    k = rng.standard_normal((40, 1, 64)).astype(np.float32)
    v = rng.standard_normal((40, 1, 64)).astype(np.float32)
    kv.add_sequence(0, num_tokens=20)
    write_kv(k[:20], v[:20], kc, vc, kv.slot_mapping([0], 20), residual_slots=np.zeros(20, np.int32))
    kv.fork(0, 1)
    copy_blocks([kc.residual], [vc.residual], np.array([[0, 1]], np.int32))  # parent slot 0 -> child slot 1
    for seq, slot, lo, hi in ((0, 0, 20, 33), (1, 1, 20, 26)):
        kv.append_tokens(seq, num_tokens=hi - lo)
        copy_blocks([kc], [vc], kv.take_copy_ops())
        src = k if seq == 0 else k[::-1].copy()
        write_kv(
            np.ascontiguousarray(src[lo:hi]),
            np.ascontiguousarray(v[lo:hi]),
            kc,
            vc,
            kv.slot_mapping([seq], hi - lo),
            residual_slots=np.full(hi - lo, slot, np.int32),
        )
    kv.check_invariants()
    q = rng.standard_normal((2, 2, 64)).astype(np.float32)
    tables, lens = kv.batch_block_tables([0, 1])
    out = paged_attention(q, kc, vc, tables, lens, residual_slots=np.array([0, 1], np.int32))
    histories = ([k[:33]], [np.concatenate([k[:20], k[::-1][20:26]])])
    for b in range(2):
        kk = np.concatenate(histories[b])
        vv = np.concatenate([v[:20], v[20 : 20 + len(kk) - 20]])
        exact = contiguous_attention(q[b], kk, vv)
        assert np.abs(out[b] - exact).max() <= VS_ORIGINAL["int4"]


def test_dequantized_history_is_what_attention_reads():
    p = make_problem(1, "int4", "float16", [21], 1, 64, 8)
    hist = dequantized_history(p, p.k_cache, 0)
    open_rows = p.keys[0][16:].astype(np.float32)
    np.testing.assert_array_equal(hist[16:], round_trip_8bit(open_rows, "int8"))  # residual: int8
    # int8's bound per (token, head): (9/16) amax / 127 (docs/quantized_kv.md, "8-bit").
    amax = np.abs(open_rows).max(axis=-1, keepdims=True)
    assert (np.abs(hist[16:] - open_rows) <= amax * 9 / 16 / 127).all()
    assert np.abs(hist[:16] - p.keys[0][:16].astype(np.float32)).max() < 0.5
    assert KIND_DTYPES["float16"] is np.float16
