"""The CUDA decode kernels, run on the CPU through the emulation harness, against the reference.

Cases cover every KV dtype x head_dim, every block size and every compiled group instance (plus
group sizes that run padded), multi-tile and multi-split sequences, with unused slots and table
padding poisoned with NaN. Shapes stay small: each block's threads are real threads.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedkv.attention import contiguous_attention, paged_attention
from pagedkv.kernels import emulation, instances

from .conftest import assert_close, make_problem, needs_cxx, stable_seed

pytestmark = needs_cxx

# (kind, head_dim, block_size, group, seq_lens, num_kv_heads)
CASES = [
    ("float16", 128, 16, 8, [1, 37, 75], 1),
    ("float16", 128, 16, 3, [40, 9], 2),
    ("float16", 128, 16, 1, [65, 2], 2),
    ("bfloat16", 128, 16, 4, [33, 70], 1),
    ("float32", 128, 16, 2, [17, 50], 2),
    ("float16", 64, 8, 4, [130, 5], 1),
    ("float16", 256, 32, 2, [45, 20], 1),
    ("float32", 64, 1, 1, [23, 40], 2),
    ("float32", 256, 8, 5, [19, 26], 1),
    ("bfloat16", 64, 32, 8, [100, 7], 1),
    ("bfloat16", 256, 1, 1, [21, 12], 2),
]


def _instances():
    out = []
    for kind, head_dim, block_size, group, _, _ in CASES:
        out.append(instances.decode_for(kind, head_dim, block_size, group))
        out.append(instances.merge(kind, head_dim))
    out.append(instances.decode("float32", 128, 16, 4))  # the stability test below
    for g in instances.GROUP_INSTANCES:  # the random-batch test below
        out.append(instances.decode_for("float16", 128, 16, g))
    return [(i.source, i.name) for i in out]


@pytest.fixture(scope="module", autouse=True)
def built():
    emulation.prebuild(_instances())


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-d{c[1]}-bs{c[2]}-g{c[3]}" for c in CASES])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_reference(case, num_splits):
    kind, head_dim, block_size, group, seq_lens, num_kv_heads = case
    rng = np.random.default_rng(stable_seed(case[:4], num_splits))
    p = make_problem(rng, kind, seq_lens, num_kv_heads, group, head_dim, block_size)
    expected = paged_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, backend="numpy")
    out = paged_attention(
        p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, backend="emulated", num_splits=num_splits
    )
    assert out.dtype == p.q.dtype and out.shape == p.q.shape
    assert_close(out, expected, kind)


def test_custom_scale_and_empty_sequence():
    rng = np.random.default_rng(3)
    p = make_problem(rng, "float16", [0, 50, 3], 1, 8, 128, 16)
    for splits in (1, 4):
        out = paged_attention(
            p.q,
            p.k_cache,
            p.v_cache,
            p.block_tables,
            p.seq_lens,
            scale=0.05,
            backend="emulated",
            num_splits=splits,
        )
        expected = paged_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, scale=0.05)
        assert_close(out, expected, "float16")
        assert np.array_equal(out[0], np.zeros_like(out[0]))


def test_more_splits_than_tiles_leave_empty_splits():
    rng = np.random.default_rng(4)
    p = make_problem(rng, "float16", [5, 64], 1, 8, 128, 16)
    out = paged_attention(
        p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, backend="emulated", num_splits=7
    )
    assert_close(out, paged_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens), "float16")


def test_contiguous_attention_through_the_kernel():
    rng = np.random.default_rng(5)
    q = rng.standard_normal((8, 128)).astype(np.float16)
    k = rng.standard_normal((29, 1, 128)).astype(np.float16)
    v = rng.standard_normal((29, 1, 128)).astype(np.float16)
    assert_close(contiguous_attention(q, k, v, backend="emulated"), contiguous_attention(q, k, v), "float16")


def test_harness_poisons_decode_shared_memory():
    kernel = emulation.get_kernel(instances.ATTENTION_SOURCE, instances.decode("float16", 128, 16, 8).name)
    assert kernel.shared_bytes() > 8 * 128 * 4  # at least q_sm is found and poisoned


@pytest.mark.parametrize("num_splits", [1, 2])
def test_full_last_blocks_with_minus_one_padding(num_splits):
    # The row after each history would sit in the block the -1 padding names: the kernel must not
    # touch it (the harness fails any 16-byte access outside the launch's arrays).
    rng = np.random.default_rng(6)
    p = make_problem(rng, "float16", [32, 48, 64], 1, 8, 128, 16)
    for b, n in enumerate(p.seq_lens):
        p.block_tables[b, n // 16 :] = -1
    out = paged_attention(
        p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, backend="emulated", num_splits=num_splits
    )
    assert_close(out, paged_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens), "float16")


@settings(max_examples=10, deadline=None)
@given(
    seq_lens=st.lists(st.integers(0, 140), min_size=1, max_size=3),
    group=st.sampled_from([1, 2, 3, 4, 5, 8]),
    num_kv_heads=st.integers(1, 2),
    num_splits=st.sampled_from([None, 1, 2, 5]),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_batches_float16_d128_bs16(seq_lens, group, num_kv_heads, num_splits, seed):
    """Random lengths (tile and split edges included) on the instances the grid above built."""
    p = make_problem(np.random.default_rng(seed), "float16", seq_lens, num_kv_heads, group, 128, 16)
    out = paged_attention(
        p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, backend="emulated", num_splits=num_splits
    )
    assert_close(out, paged_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens), "float16")


@pytest.mark.parametrize("num_splits", [1, 3])
def test_softmax_is_stable_when_the_max_moves_between_tiles_and_splits(num_splits):
    """Scores in the hundreds, growing along the sequence: every tile and split raises the running
    max, so any missing rescale (or an exp without the max subtracted) breaks the result."""
    rng = np.random.default_rng(8)
    p = make_problem(rng, "float32", [90, 61], 1, 4, 128, 16)
    p.q[:] = np.abs(p.q) * 3
    for b, n in enumerate(p.seq_lens):
        ramp = np.linspace(0.0, 4.0, int(n), dtype=np.float32)[:, None, None]
        for t in range(int(n)):
            blk, off = p.block_tables[b, t // 16], t % 16
            p.k_cache[blk, off] = np.abs(p.k_cache[blk, off]) * ramp[t]
    expected = paged_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens)
    out = paged_attention(
        p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, backend="emulated", num_splits=num_splits
    )
    assert_close(out, expected, "float32")
