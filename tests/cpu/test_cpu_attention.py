"""backend="cpu" attention against the NumPy reference (the bit-exact reference).

Tolerance (docs/cpu_data_plane.md): the Rust kernels accumulate in fp32 like the reference but in
another order (SIMD partial sums, online softmax), so fp32 outputs agree to 2e-5 absolute for
values in [-1, 1] (scores of O(1)); fp16 / bf16 outputs, both rounded from fp32, differ by at
most one rounding step of the output (2^-10 / 2^-7 absolute for outputs in [-1, 1]).

Caches are NaN-poisoned everywhere no sequence wrote; table padding is -1; blocks are scattered.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedkv.attention import (
    contiguous_attention,
    cpu_backend,
    paged_attention,
    paged_prefill_attention,
)
from pagedkv.attention.dtypes import bf16_bits_to_float32, float32_to_bf16_bits
from pagedkv.errors import InvalidArgumentError

KINDS = ("float32", "float16", "bfloat16")
TOLERANCE = {"float32": 2e-5, "float16": 2.0**-10, "bfloat16": 2.0**-7}


def encode(x: np.ndarray, kind: str) -> np.ndarray:
    if kind == "bfloat16":
        return float32_to_bf16_bits(x)
    return x.astype(np.float16 if kind == "float16" else np.float32)


def decode(x: np.ndarray, kind: str) -> np.ndarray:
    return bf16_bits_to_float32(x) if kind == "bfloat16" else x.astype(np.float32)


def nan_of(kind: str) -> object:
    return 0x7FC0 if kind == "bfloat16" else np.nan


@st.composite
def batches(draw: st.DrawFn, prefill: bool) -> dict[str, object]:
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    num_kv_heads = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([4, 8, 32, 64]))
    lens = draw(st.lists(st.integers(1 if prefill else 0, 40), min_size=1, max_size=4))
    q_lens = [draw(st.integers(0, min(n, 5))) for n in lens] if prefill else [1] * len(lens)
    kind = draw(st.sampled_from(KINDS))
    seed = draw(st.integers(0, 2**31))
    return {
        "block_size": block_size,
        "num_kv_heads": num_kv_heads,
        "group": group,
        "head_dim": head_dim,
        "lens": lens,
        "q_lens": q_lens,
        "kind": kind,
        "seed": seed,
    }


def build(case: dict[str, object]) -> dict[str, np.ndarray]:
    """Caches with each sequence's tokens in reversed, scattered blocks, NaN everywhere else."""
    rng = np.random.default_rng(case["seed"])  # type: ignore[arg-type]
    bs, nkv, group, hd = (int(case[k]) for k in ("block_size", "num_kv_heads", "group", "head_dim"))  # type: ignore[call-overload]
    lens: list[int] = case["lens"]  # type: ignore[assignment]
    kind = str(case["kind"])
    needed = [-(-n // bs) for n in lens]
    num_blocks = sum(needed) + 2
    max_blocks = max(needed) + 1
    dtype = np.uint16 if kind == "bfloat16" else (np.float16 if kind == "float16" else np.float32)
    k_cache = np.full((num_blocks, bs, nkv, hd), nan_of(kind), dtype=dtype)
    v_cache = np.full_like(k_cache, nan_of(kind))
    tables = np.full((len(lens), max_blocks), -1, np.int32)
    free = list(rng.permutation(num_blocks))
    for i, n in enumerate(lens):
        for j in range(needed[i]):
            tables[i, j] = free.pop()
        for pos in range(n):
            blk, off = tables[i, pos // bs], pos % bs
            k_cache[blk, off] = encode(rng.uniform(-1, 1, (nkv, hd)).astype(np.float32), kind)
            v_cache[blk, off] = encode(rng.uniform(-1, 1, (nkv, hd)).astype(np.float32), kind)
    q_lens: list[int] = case["q_lens"]  # type: ignore[assignment]
    q = encode(rng.uniform(-1, 1, (sum(q_lens), nkv * group, hd)).astype(np.float32), kind)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return {
        "q": q,
        "k": k_cache,
        "v": v_cache,
        "tables": tables,
        "lens": np.array(lens, np.int32),
        "qsl": qsl,
    }


def assert_close(got: np.ndarray, want: np.ndarray, kind: str) -> None:
    g, w = decode(got, kind), decode(want, kind)
    assert np.isfinite(g).all(), "NaN or inf leaked from an unused slot"
    np.testing.assert_allclose(g, w, rtol=0, atol=TOLERANCE[kind])


@settings(max_examples=60)
@given(batches(prefill=False))
def test_decode_matches_reference(case: dict[str, object]) -> None:
    a = build(case)
    want = paged_attention(a["q"], a["k"], a["v"], a["tables"], a["lens"])
    got = paged_attention(a["q"], a["k"], a["v"], a["tables"], a["lens"], backend="cpu")
    assert got.dtype == want.dtype and got.shape == want.shape
    assert_close(got, want, str(case["kind"]))


@settings(max_examples=60)
@given(batches(prefill=True), st.booleans())
def test_prefill_matches_reference(case: dict[str, object], causal: bool) -> None:
    a = build(case)
    args = (a["q"], a["k"], a["v"], a["tables"], a["lens"], a["qsl"])
    want = paged_prefill_attention(*args, causal=causal)
    got = paged_prefill_attention(*args, causal=causal, backend="cpu")
    assert_close(got, want, str(case["kind"]))


@settings(max_examples=25)
@given(batches(prefill=True))
def test_prefill_csr_tables_equal_padded(case: dict[str, object]) -> None:
    a = build(case)
    bs = int(a["k"].shape[1])
    lens = a["lens"]
    needed = -(-lens.astype(np.int64) // bs)
    indptr = np.concatenate([[0], np.cumsum(needed)]).astype(np.int32)
    indices = np.concatenate([a["tables"][i, : needed[i]] for i in range(len(lens))]).astype(np.int32)
    last = np.where(lens == 0, 0, (lens - 1) % bs + 1).astype(np.int32)
    padded = paged_prefill_attention(a["q"], a["k"], a["v"], a["tables"], lens, a["qsl"], backend="cpu")
    csr = paged_prefill_attention(
        a["q"], a["k"], a["v"], (indptr, indices, last), lens, a["qsl"], backend="cpu"
    )
    np.testing.assert_array_equal(padded, csr)


@settings(max_examples=30)
@given(batches(prefill=True), st.integers(1, 12))
def test_window_equals_reference_over_the_last_keys_and_skips_released_blocks(
    case: dict[str, object], window: int
) -> None:
    """A windowed query equals the reference's attention over its last ``window`` keys, and the
    table entries of blocks wholly before the window may be -1 (released) without an error."""
    a = build(case)
    bs = int(a["k"].shape[1])
    kind = str(case["kind"])
    lens, qsl = a["lens"], a["qsl"]
    tables = a["tables"].copy()
    for i, n in enumerate(lens.tolist()):
        q_len = int(qsl[i + 1] - qsl[i])
        first_key = max(0, n - q_len + 1 - window)
        tables[i, : first_key // bs] = -1
    got = cpu_backend.paged_prefill_attention(a["q"], a["k"], a["v"], tables, lens, qsl, window=window)
    for i, n in enumerate(lens.tolist()):
        q0, q1 = int(qsl[i]), int(qsl[i + 1])
        for r in range(q0, q1):
            pos = n - (q1 - q0) + (r - q0)
            lo = max(0, pos + 1 - window)
            rows = [a["tables"][i, t // bs] * bs + t % bs for t in range(lo, pos + 1)]
            flat_k = a["k"].reshape(-1, *a["k"].shape[2:])
            flat_v = a["v"].reshape(-1, *a["v"].shape[2:])
            want = contiguous_attention(a["q"][r], flat_k[rows], flat_v[rows])
            assert_close(got[r], want, kind)


@settings(max_examples=30)
@given(batches(prefill=True), st.integers(1, 12))
def test_public_window_on_cpu_equals_the_numpy_reference(case: dict[str, object], window: int) -> None:
    """``paged_prefill_attention(..., window=, backend="cpu")`` and the decode entry point equal
    the NumPy reference's windowed results (within the stated tolerance) on tables whose
    out-of-window blocks are released (-1)."""
    a = build(case)
    bs = int(a["k"].shape[1])
    lens, qsl = a["lens"], a["qsl"]
    tables = a["tables"].copy()
    for i, n in enumerate(lens.tolist()):
        q_len = int(qsl[i + 1] - qsl[i])
        tables[i, : max(0, n - q_len + 1 - window) // bs] = -1
    args = (a["q"], a["k"], a["v"], tables, lens, qsl)
    got = paged_prefill_attention(*args, window=window, backend="cpu")
    want = paged_prefill_attention(*args, window=window, backend="numpy")
    assert_close(got, want, str(case["kind"]))
    last = qsl[1:] - 1  # each sequence's last query row, as a decode
    decoded = [i for i in range(len(lens)) if qsl[i + 1] > qsl[i]]
    if decoded:
        q = a["q"][last[decoded]]
        sub_tables, sub_lens = tables[decoded], lens[decoded]
        got_d = paged_attention(q, a["k"], a["v"], sub_tables, sub_lens, window=window, backend="cpu")
        want_d = paged_attention(q, a["k"], a["v"], sub_tables, sub_lens, window=window, backend="numpy")
        assert_close(got_d, want_d, str(case["kind"]))


def test_decode_window_reads_no_released_block() -> None:
    rng = np.random.default_rng(1)
    k = rng.standard_normal((4, 4, 1, 8)).astype(np.float32)
    q = rng.standard_normal((1, 2, 8)).astype(np.float32)
    tables = np.array([[-1, -1, 2, 3]], np.int32)  # blocks 0 and 1 released
    lens = np.array([16], np.int32)
    got = cpu_backend.paged_attention(q, k, k, tables, lens, window=7)  # keys 9..15: blocks 2, 3
    want = contiguous_attention(q[0], np.concatenate([k[2], k[3]])[1:], np.concatenate([k[2], k[3]])[1:])
    np.testing.assert_allclose(got[0], want, atol=2e-5)
    with pytest.raises(InvalidArgumentError, match="block"):
        cpu_backend.paged_attention(q, k, k, tables, lens, window=9)  # would need block 1


def test_contiguous_attention_cpu() -> None:
    rng = np.random.default_rng(2)
    q = rng.standard_normal((4, 16)).astype(np.float32)
    k = rng.standard_normal((9, 2, 16)).astype(np.float32)
    v = rng.standard_normal((9, 2, 16)).astype(np.float32)
    np.testing.assert_allclose(
        contiguous_attention(q, k, v, backend="cpu"), contiguous_attention(q, k, v), atol=2e-5
    )
    assert not contiguous_attention(q, k[:0], v[:0], backend="cpu").any()
