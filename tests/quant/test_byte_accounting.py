"""Exact byte accounting of the quantized caches: what one block holds, what a budget admits.

The numbers at block 16, 2 KV heads, head_dim 64 are docs/quantized_kv.md's table; the capacity
claims (8-bit >= 1.95x, int4 >= 3.5x of fp16 in sequences per byte budget) are checked here on
the byte arithmetic for the engine's two models, residual slots included."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedkv.attention import (
    QuantizedKvCache,
    block_bytes,
    blocks_for_memory,
    kv_block_bytes,
    residual_bytes,
    sequences_for_memory,
)
from pagedkv.attention.kv_cache_dtype import QUANTIZED_DTYPES, block_layout
from pagedkv.errors import InvalidArgumentError


@pytest.mark.parametrize(
    ("dtype", "key", "value"),
    [
        ("float16", 4096, 4096),
        ("bfloat16", 4096, 4096),
        ("float32", 8192, 8192),
        ("int8", 2080, 2080),
        ("fp8_e4m3", 2080, 2080),
        ("int4", 1168, 1072),
    ],
)
def test_block_bytes_at_block_16_two_heads_head_dim_64(dtype, key, value):
    assert block_bytes(dtype, 16, 2, 64, role="key") == key
    assert block_bytes(dtype, 16, 2, 64, role="value") == value
    assert kv_block_bytes(dtype, 16, 2, 64, num_layers=30) == 30 * (key + value)


def test_the_int4_layout_parts():
    k, v = block_layout("int4", "key", 16, 2, 64), block_layout("int4", "value", 16, 2, 64)
    # codes: 16 tokens x 2 heads x 64 channels / 2; metadata: a byte per (head, channel) for keys,
    # per (token, head) for values; three bfloat16 per head; zero padding to 16 bytes.
    assert (k.codes_bytes, k.meta_bytes, k.side_offset, k.side_bytes, k.block_bytes) == (
        1024,
        128,
        1152,
        12,
        1168,
    )
    assert (v.codes_bytes, v.meta_bytes, v.side_offset, v.side_bytes, v.block_bytes) == (
        1024,
        32,
        1056,
        12,
        1072,
    )


@settings(max_examples=200, deadline=None)
@given(
    dtype=st.sampled_from(QUANTIZED_DTYPES),
    role=st.sampled_from(("key", "value")),
    block_size=st.integers(1, 64),
    heads=st.integers(1, 16),
    half_dim=st.integers(1, 160),
)
def test_every_layout_is_packed_aligned_and_complete(dtype, role, block_size, heads, half_dim):
    dim = 2 * half_dim
    lay = block_layout(dtype, role, block_size, heads, dim)
    code_bits = 4 if dtype == "int4" else 8
    assert lay.codes_bytes * 8 == block_size * heads * dim * code_bits
    assert lay.meta_offset == lay.codes_bytes
    groups = (heads * dim if role == "key" else block_size * heads) if dtype == "int4" else block_size * heads
    assert lay.meta_bytes == groups
    assert lay.side_bytes == (6 * heads if dtype == "int4" else 0)
    assert lay.side_offset >= lay.meta_offset + lay.meta_bytes
    assert dtype != "int4" or lay.side_offset % 2 == 0  # bfloat16 side parameters are 2-byte aligned
    end = lay.side_offset + lay.side_bytes
    assert (
        lay.block_bytes % 16 == 0 and 0 <= lay.block_bytes - end < 16
    )  # no more padding than alignment needs


def test_a_cache_holds_exactly_its_blocks_and_residual_slots():
    c = QuantizedKvCache.empty("int4", "key", 10, 16, 2, 64, num_residual_slots=3)
    assert c.data.shape == (10, 1168) and c.data.dtype == np.uint8
    # The residual slots: an int8 cache of the same role and geometry, a block per slot.
    r = c.residual
    assert (r.kv_cache_dtype, r.role, r.shape, r.residual) == ("int8", "key", (3, 16, 2, 64), None)
    assert r.data.shape == (3, 2080) and c.num_residual_slots == 3
    assert c.nbytes == 10 * 1168 + 3 * 2080
    assert c.shape == (10, 16, 2, 64)
    c8 = QuantizedKvCache.empty("int8", "value", 4, 8, 1, 128)
    assert c8.residual is None and c8.nbytes == 4 * block_bytes("int8", 8, 1, 128)


def test_residual_bytes_count_keys_and_values_of_every_layer():
    # An int8 block of K and V per layer: codes, a scale byte per (token, head): about half of
    # a float16 block (docs/quantized_kv.md, "Byte accounting").
    assert residual_bytes("int4", 16, 2, 64, num_layers=30) == 30 * 2 * (16 * 2 * 64 + 16 * 2)
    assert residual_bytes("int4", 16, 1, 256, num_layers=18) == 18 * 2 * (16 * 256 + 16)
    for dtype in ("float16", "int8", "fp8_e4m3"):
        assert residual_bytes(dtype, 16, 2, 64, num_layers=30) == 0


def test_blocks_for_memory_counts_codes_scales_and_residual_slots():
    per_block = kv_block_bytes("int8", 16, 3, 64, 30)
    assert blocks_for_memory(10 * per_block + per_block - 1, "int8", 16, 3, 64, 30) == 10
    # The unquantized caches: the formula docs/embedding.md sizes a pool with.
    assert blocks_for_memory(2 << 30, "float16", 16, 8, 128, 32) == (2 << 30) // (2 * 32 * 16 * 8 * 128 * 2)
    budget = 1 << 26
    res = residual_bytes("int4", 16, 3, 64, 30)
    assert blocks_for_memory(budget, "int4", 16, 3, 64, 30, max_num_seqs=8) == (
        budget - 8 * res
    ) // kv_block_bytes("int4", 16, 3, 64, 30)
    with pytest.raises(InvalidArgumentError, match="residual slots"):
        blocks_for_memory(res - 1, "int4", 16, 3, 64, 30, max_num_seqs=1)
    with pytest.raises(InvalidArgumentError):
        blocks_for_memory(-1, "int8", 16, 3, 64)


@pytest.mark.parametrize(
    ("heads", "dim", "layers"), [(3, 64, 30), (1, 256, 18)], ids=["smollm2", "gemma3-270m"]
)
@pytest.mark.parametrize("context", [2048, 8192])
def test_capacity_against_fp16_at_a_fixed_budget(heads, dim, layers, context):
    """Sequences of ``context`` tokens a 64 GiB budget holds (int4: each with its int8 residual
    slot): >= 1.95x fp16's for the 8-bit dtypes, >= 3.5x for int4."""
    budget = 64 << 30
    fp16 = sequences_for_memory(budget, context, "float16", 16, heads, dim, layers)
    assert fp16 > 100
    for dtype, goal in (("int8", 1.95), ("fp8_e4m3", 1.95), ("int4", 3.5)):
        assert sequences_for_memory(budget, context, dtype, 16, heads, dim, layers) >= goal * fp16, dtype


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: block_bytes("fp8", 16, 2, 64), "kv_cache_dtype"),
        (lambda: block_bytes("int4", 16, 2, 63), "even"),
        (lambda: block_bytes("int8", 0, 2, 64), "block_size"),
        (lambda: block_layout("int4", "query", 16, 2, 64), "role"),
        (lambda: block_layout("float16", "key", 16, 2, 64), "not quantized"),
        (lambda: residual_bytes("int4", 16, 2, 64, num_layers=0), "num_layers"),
        (lambda: QuantizedKvCache.empty("int4", "key", -1, 16, 2, 64), "num_blocks"),
        (lambda: QuantizedKvCache(np.zeros((1, 1168), np.uint8), "int4", "key", 16, 2, 64), "residual"),
        (
            lambda: QuantizedKvCache(np.zeros((1, 2080), np.uint8), "int8", "key", 16, 2, 64, np.zeros(1)),
            "residual",
        ),
    ],
)
def test_bad_arguments_are_typed_errors(call, message):
    with pytest.raises(InvalidArgumentError, match=message):
        call()
