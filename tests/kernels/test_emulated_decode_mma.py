"""The tensor-core decode kernel (paged_decode_mma.cu), run on the CPU through the emulation
harness (mma.sync / ldmatrix / cp.async with the PTX ISA's fragment layouts), against the NumPy
reference.

Covered: fp16 and bf16; group instances 4 (groups 3, 4) and 8 (groups 5..8, padded to mma's n = 8);
head dims 64, 128 and 256; block sizes 1, 8, 16 and 32; ragged lengths that end inside tiles and
blocks, an empty sequence, several KV heads, one and several splits (including more splits than a
sequence has tiles), and a moving softmax max. Every cache slot no sequence uses is NaN and table
padding names NaN blocks or -1 (make_problem), so a stray read shows as NaN in the output.
Tolerance: conftest.TOLERANCE (fp16 2e-3, bf16 1.6e-2 abs + rel): P is rounded to the cache's
16-bit type for the P.V mma, within an ulp of the output's own rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
from pagedkv.attention import paged_attention
from pagedkv.attention import validation as val
from pagedkv.attention.kernel_launch import decode_instance
from pagedkv.kernels import emulation, instances

from .conftest import assert_close, make_problem, needs_cxx, stable_seed

pytestmark = needs_cxx

# (kind, head_dim, block_size, group, seq_lens, num_kv_heads); lengths kept small (the emulator
# runs every thread as a real thread): tiles hold 64 / 32 / 16 tokens at head_dim 64 / 128 / 256.
CASES = [
    ("float16", 64, 8, 4, [130, 5, 0], 1),
    ("float16", 128, 16, 7, [33, 64, 1], 1),
    ("float16", 256, 32, 3, [45, 17], 2),
    ("bfloat16", 64, 32, 8, [77, 12], 2),
    ("bfloat16", 128, 1, 5, [21, 40], 1),
    ("bfloat16", 256, 16, 6, [50, 16], 1),
]


def _instances():
    out = []
    for kind, head_dim, block_size, group, _, _ in CASES:
        out.append(instances.decode_for(kind, head_dim, block_size, group))
        out.append(instances.merge(kind, head_dim))
    return [(i.source, i.name) for i in out]


@pytest.fixture(scope="module", autouse=True)
def built():
    emulation.prebuild(_instances())


def _shape(kind: str, head_dim: int, group: int) -> val.AttentionShape:
    return val.AttentionShape(1, group, 1, head_dim, 16, 4, 1, group, kind, 1.0)


@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", instances.HEAD_DIMS)
def test_launcher_runs_groups_3_to_8_of_16_bit_caches_on_tensor_cores(kind, head_dim):
    for group in range(1, instances.MAX_GROUP + 1):
        name = decode_instance(_shape(kind, head_dim, group)).name
        assert ("paged_decode_mma_kernel" in name) == (3 <= group <= 8), (group, name)
    # fp32 caches keep the CUDA-core kernel at every group.
    assert "paged_decode_kernel<float," in decode_instance(_shape("float32", head_dim, 8)).name


def test_every_launchable_decode_instance_is_compiled():
    compiled = {i.name for i in instances.all_instances()}
    for kind in instances.KERNEL_TYPES:
        for head_dim in instances.HEAD_DIMS:
            for block_size in instances.BLOCK_SIZES:
                for group in range(1, instances.MAX_GROUP + 1):
                    assert instances.decode_for(kind, head_dim, block_size, group).name in compiled


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-d{c[1]}-bs{c[2]}-g{c[3]}" for c in CASES])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_tensor_core_decode_matches_reference(case, num_splits):
    kind, head_dim, block_size, group, seq_lens, num_kv_heads = case
    rng = np.random.default_rng(stable_seed(case[:4], num_splits))
    p = make_problem(rng, kind, seq_lens, num_kv_heads, group, head_dim, block_size)
    shape = _shape(kind, head_dim, group)
    assert "paged_decode_mma_kernel" in decode_instance(shape).name
    expected = paged_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, backend="numpy")
    out = paged_attention(
        p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, backend="emulated", num_splits=num_splits
    )
    assert out.dtype == p.q.dtype and out.shape == p.q.shape
    assert_close(out, expected, kind)


def test_more_splits_than_tiles_and_minus_one_padding():
    """8 splits of one 64-token tile over lengths up to 130: most splits of the short sequences
    are empty (max -inf, sum 0 into the merge); the table past each history is -1."""
    rng = np.random.default_rng(11)
    p = make_problem(rng, "float16", [130, 5, 0], 1, 4, 64, 8)
    for b, n in enumerate(p.seq_lens):
        p.block_tables[b, -(-int(n) // 8) :] = -1
    out = paged_attention(
        p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, backend="emulated", num_splits=8
    )
    assert_close(out, paged_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens), "float16")


@pytest.mark.parametrize("num_splits", [1, 2])
def test_softmax_is_stable_when_the_max_moves_between_tiles(num_splits):
    """Scores grow along the sequence (tens in the log2 domain): every tile raises the running
    max, so a missing or misrouted alpha (heads 2 tig, 2 tig + 1 of the O^T columns) shows."""
    rng = np.random.default_rng(12)
    p = make_problem(rng, "float16", [96, 70], 1, 7, 128, 16)
    p.q[:] = np.abs(p.q)
    for b, n in enumerate(p.seq_lens):
        for t in range(int(n)):
            blk, off = p.block_tables[b, t // 16], t % 16
            p.k_cache[blk, off] = (np.abs(p.k_cache[blk, off].astype(np.float32)) * (0.5 + t / 24)).astype(
                np.float16
            )
    # Different scales per head: the heads' maxima move differently.
    p.q *= np.linspace(0.5, 1.5, p.q.shape[1], dtype=np.float16)[None, :, None]
    expected = paged_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens)
    out = paged_attention(
        p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, backend="emulated", num_splits=num_splits
    )
    assert_close(out, expected, "float16")
