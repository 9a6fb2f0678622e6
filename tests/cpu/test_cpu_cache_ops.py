"""backend="cpu" write_kv, copy_blocks and swap_blocks: bit-identical to the NumPy reference (they
only move bytes), and hostile inputs refused with InvalidArgumentError before any write."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedkv.attention import copy_blocks, paged_attention, paged_prefill_attention, swap_blocks, write_kv
from pagedkv.errors import InvalidArgumentError

DTYPES = (np.float32, np.float16, np.uint16)  # uint16: bfloat16 bit patterns


def caches(rng: np.random.Generator, dtype: type, shape: tuple[int, ...]) -> np.ndarray:
    return rng.integers(0, 2**15, shape).astype(np.uint16).view(np.uint16).astype(dtype)


@settings(max_examples=40)
@given(
    st.sampled_from(DTYPES),
    st.integers(1, 6),
    st.sampled_from([1, 4, 16]),
    st.integers(0, 2**31),
    st.data(),
)
def test_write_kv_equals_reference(
    dtype: type, num_blocks: int, bs: int, seed: int, data: st.DataObject
) -> None:
    rng = np.random.default_rng(seed)
    shape = (num_blocks, bs, 2, 8)
    slots = data.draw(st.lists(st.integers(-1, num_blocks * bs - 1), max_size=12))
    real = [s for s in slots if s >= 0]
    if len(set(real)) != len(real):
        slots = [-1] * len(slots)
    slot_mapping = np.array(slots, np.int64)
    k = caches(rng, dtype, (len(slots), 2, 8))
    v = caches(rng, dtype, (len(slots), 2, 8))
    ref_k, ref_v = caches(rng, dtype, shape), caches(rng, dtype, shape)
    cpu_k, cpu_v = ref_k.copy(), ref_v.copy()
    write_kv(k, v, ref_k, ref_v, slot_mapping)
    write_kv(k, v, cpu_k, cpu_v, slot_mapping, backend="cpu")
    assert ref_k.tobytes() == cpu_k.tobytes() and ref_v.tobytes() == cpu_v.tobytes()


@settings(max_examples=40)
@given(st.sampled_from(DTYPES), st.integers(1, 8), st.integers(0, 2**31), st.data())
def test_copy_and_swap_equal_reference(dtype: type, num_blocks: int, seed: int, data: st.DataObject) -> None:
    rng = np.random.default_rng(seed)
    shape = (num_blocks, 2, 1, 4)
    ops = data.draw(
        st.lists(st.tuples(st.integers(0, num_blocks - 1), st.integers(0, num_blocks - 1)), max_size=6)
    )
    copy_ops = np.array(ops, np.int32).reshape(-1, 2)
    layers = [caches(rng, dtype, shape) for _ in range(4)]
    ref = [x.copy() for x in layers]
    copy_blocks(ref[:2], ref[2:], copy_ops)
    copy_blocks(layers[:2], layers[2:], copy_ops, backend="cpu")
    assert all(a.tobytes() == b.tobytes() for a, b in zip(ref, layers, strict=True))

    dst_blocks = data.draw(st.lists(st.integers(0, 9), unique=True, max_size=num_blocks))
    srcs = data.draw(
        st.lists(st.integers(0, num_blocks - 1), min_size=len(dst_blocks), max_size=len(dst_blocks))
    )
    mapping = np.array(list(zip(srcs, dst_blocks, strict=True)), np.int32).reshape(-1, 2)
    host_ref = caches(rng, dtype, (10, *shape[1:]))
    host_cpu = host_ref.copy()
    n_ref = swap_blocks(layers[0], host_ref, mapping)
    n_cpu = swap_blocks(layers[0], host_cpu, mapping, backend="cpu")
    assert n_ref == n_cpu and host_ref.tobytes() == host_cpu.tobytes()


def _setup() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    k_cache = np.zeros((4, 4, 2, 8), np.float32)
    v_cache = np.zeros_like(k_cache)
    k = np.ones((2, 2, 8), np.float32)
    return k_cache, v_cache, k, k.copy()


@pytest.mark.parametrize(
    "slots",
    [[0, 16], [-2, 0], [3, 3], [0, 2**40]],
    ids=["past-end", "below-minus-one", "twice", "huge"],
)
def test_write_kv_refuses_bad_slots_without_writing(slots: list[int]) -> None:
    k_cache, v_cache, k, v = _setup()
    with pytest.raises(InvalidArgumentError):
        write_kv(k, v, k_cache, v_cache, np.array(slots, np.int64), backend="cpu")
    assert not k_cache.any() and not v_cache.any()


def test_hostile_arguments_are_refused() -> None:
    k_cache, v_cache, k, v = _setup()
    slots = np.array([0, 1], np.int64)
    bad = [
        lambda: write_kv(k, v, k_cache, v_cache, slots.astype(np.int32), backend="cpu"),  # dtype
        lambda: write_kv(k.astype(np.float64), v, k_cache, v_cache, slots, backend="cpu"),
        lambda: write_kv(k, v, k_cache[:, ::2], v_cache[:, ::2], slots, backend="cpu"),  # strided
        lambda: write_kv(k, v, k_cache, k_cache, slots, backend="cpu"),  # one array twice
        lambda: write_kv(k, v, k_cache.astype(np.float64), v_cache.astype(np.float64), slots, backend="cpu"),
        lambda: write_kv(k[:1], v, k_cache, v_cache, slots, backend="cpu"),
        lambda: write_kv(k.tolist(), v, k_cache, v_cache, slots, backend="cpu"),
        lambda: copy_blocks([k_cache], [v_cache], np.array([[0, 4]], np.int32), backend="cpu"),
        lambda: copy_blocks([k_cache], [v_cache], np.array([[-1, 0]], np.int32), backend="cpu"),
        lambda: copy_blocks([k_cache], [v_cache], np.array([[0, 1]], np.int64), backend="cpu"),
        lambda: copy_blocks([k_cache], [], np.zeros((0, 2), np.int32), backend="cpu"),
        lambda: swap_blocks(k_cache, v_cache[:2], np.array([[0, 2]], np.int32), backend="cpu"),
        lambda: swap_blocks(k_cache, v_cache, np.array([[0, 1], [2, 1]], np.int32), backend="cpu"),
        lambda: swap_blocks(k_cache, k_cache, np.array([[0, 1]], np.int32), backend="cpu"),
    ]
    for i, call in enumerate(bad):
        with pytest.raises(InvalidArgumentError):
            call()
        assert not k_cache.any() and not v_cache.any(), f"call {i} wrote before failing"


def test_attention_refuses_bad_tables_and_shapes() -> None:
    k_cache = np.zeros((4, 4, 2, 8), np.float32)
    q = np.zeros((1, 4, 8), np.float32)
    lens = np.array([6], np.int32)
    for table in ([[0, 4]], [[0, -1]], [[0, 2**31 - 1]]):
        with pytest.raises(InvalidArgumentError, match="block"):
            paged_attention(q, k_cache, k_cache, np.array(table, np.int32), lens, backend="cpu")
    tables = np.array([[0, 1]], np.int32)
    bad = [
        lambda: paged_attention(q, k_cache, k_cache, tables, np.array([9], np.int32), backend="cpu"),
        lambda: paged_attention(q, k_cache, k_cache, tables, np.array([-1], np.int32), backend="cpu"),
        lambda: paged_attention(q, k_cache, k_cache, tables.astype(np.int64), lens, backend="cpu"),
        lambda: paged_attention(q[:, :3], k_cache, k_cache, tables, lens, backend="cpu"),  # GQA
        lambda: paged_attention(q.astype(np.float16), k_cache, k_cache, tables, lens, backend="cpu"),
        lambda: paged_attention(q, k_cache[:, :, :, ::2], k_cache, tables, lens, backend="cpu"),
        lambda: paged_attention(q, k_cache, k_cache, tables, lens, scale=float("nan"), backend="cpu"),
        lambda: paged_prefill_attention(
            q, k_cache, k_cache, tables, lens, np.array([0, 2], np.int32), backend="cpu"
        ),
        lambda: paged_prefill_attention(
            q, k_cache, k_cache, tables, np.array([0], np.int32), np.array([0, 1], np.int32), backend="cpu"
        ),
    ]
    for call in bad:
        with pytest.raises(InvalidArgumentError):
            call()


def test_non_contiguous_queries_are_converted() -> None:
    rng = np.random.default_rng(3)
    k_cache = rng.standard_normal((2, 4, 1, 8)).astype(np.float32)
    q_wide = rng.standard_normal((2, 1, 16)).astype(np.float32)
    q = q_wide[:, :, ::2]
    tables = np.array([[0, 1], [1, 0]], np.int32)
    lens = np.array([7, 5], np.int32)
    np.testing.assert_allclose(
        paged_attention(q, k_cache, k_cache, tables, lens, backend="cpu"),
        paged_attention(np.ascontiguousarray(q), k_cache, k_cache, tables, lens),
        atol=2e-5,
    )
