"""The tensor-core prefill kernel (paged_prefill.cu) run on the CPU through the emulation harness,
against the NumPy reference. Unused cache slots and table padding are NaN, so any stray read shows;
outputs are NaN-poisoned before the launch, so any unwritten row shows.

Tolerance (both sides accumulate in fp32; the kernel rounds P to the input type before P V, as
FlashAttention does): fp16 2e-3, bf16 1.6e-2 (conftest.TOLERANCE). Shapes stay small: every
emulated launch runs 128 real threads on the CI's 2 cores.
"""

from __future__ import annotations

import numpy as np
import pagedkv
import pytest
from pagedkv.attention import paged_attention, paged_prefill_attention
from pagedkv.kernels import emulation, instances

from .conftest import assert_close, needs_cxx
from .prefill_problems import make_prefill_problem

pytestmark = needs_cxx

# (kind, head_dim, block_size): the instances these tests launch.
USED = [("float16", 128, 16), ("bfloat16", 64, 8), ("float16", 64, 1), ("bfloat16", 128, 32)]


@pytest.fixture(scope="module", autouse=True)
def built():
    built = [instances.prefill(*u) for u in USED] + [instances.merge_prefill("float16", 64)]
    emulation.prebuild([(i.source, i.name) for i in built], jobs=2)


def check(p, kind, layout="padded", causal=True):
    out = paged_prefill_attention(*p.args(layout), causal=causal, backend="emulated")
    ref = paged_prefill_attention(*p.args(layout), causal=causal)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert_close(out, ref, kind)


@pytest.mark.parametrize("layout", ["padded", "csr"])
def test_mixed_batch_fp16_d128(layout):
    # plain prefill over two row tiles (20 tokens x group 4 = 80 rows), prefix-hit suffix,
    # decode, a row with no queries; 33 + 0 keys span two K/V tiles of 32.
    p = make_prefill_problem(
        np.random.default_rng(1), "float16", [0, 20, 40, 33], [20, 5, 1, 0], 1, 4, 128, 16
    )
    check(p, "float16", layout)


def test_bf16_d64_group3_long_context():
    # 70 cached keys: two K/V tiles of 64 (the double-buffered path), group 3 packs unevenly.
    p = make_prefill_problem(np.random.default_rng(2), "bfloat16", [70, 3], [6, 9], 2, 3, 64, 8)
    check(p, "bfloat16")


def test_block_size_1_non_causal():
    p = make_prefill_problem(np.random.default_rng(3), "float16", [7, 0], [4, 5], 2, 2, 64, 1)
    check(p, "float16", causal=False)


def test_block_size_32_chunked_prefill_chunk():
    # One chunk of a chunked prefill: 37 earlier tokens cached, 11 new; group 8 as in Llama-3.
    p = make_prefill_problem(np.random.default_rng(4), "bfloat16", [37], [11], 1, 8, 128, 32)
    check(p, "bfloat16", layout="csr")


def test_decode_rows_match_the_decode_reference():
    p = make_prefill_problem(np.random.default_rng(5), "float16", [9, 31, 0], [1, 1, 1], 1, 4, 64, 1)
    out = paged_prefill_attention(*p.args(), backend="emulated")
    ref = paged_attention(p.q, p.paged.k_cache, p.paged.v_cache, p.paged.block_tables, p.seq_lens)
    assert_close(out, ref, "float16")


@pytest.mark.parametrize(
    "kind,head_dim,match",
    [("float32", 64, "tensor cores"), ("float16", 256, "no compiled prefill kernel")],
)
def test_uncompiled_shapes_are_refused(kind, head_dim, match):
    p = make_prefill_problem(np.random.default_rng(6), kind, [3], [2], 1, 1, head_dim, 16)
    with pytest.raises(pagedkv.InvalidArgumentError, match=match):
        paged_prefill_attention(*p.args(), backend="emulated")


def test_no_queries_launches_nothing():
    p = make_prefill_problem(np.random.default_rng(7), "float16", [5, 2], [0, 0], 1, 2, 64, 8)
    out = paged_prefill_attention(*p.args(), backend="emulated")
    assert out.shape == (0, 2, 64)


def test_work_tiles_cover_every_packed_row_once():
    from pagedkv.attention.prefill_launch import work_tiles

    qsl = np.array([0, 20, 20, 21, 100], np.int32)
    seq, row0 = work_tiles(qsl, 4)
    rows = instances.PREFILL_ROWS
    assert seq.tolist() == [0, 0, 2, 3, 3, 3, 3, 3]
    assert row0.tolist() == [0, rows, 0, 0, rows, 2 * rows, 3 * rows, 4 * rows]


@pytest.mark.parametrize("num_splits", [2, 5])
def test_split_kv_matches_reference(num_splits):
    # Decode rows and a short suffix over long contexts: the split-KV path with its merge. With
    # causal masking some rows of a split see no key at all (weight 0 in the merge).
    p = make_prefill_problem(np.random.default_rng(8), "float16", [200, 150, 90], [1, 9, 0], 1, 4, 64, 8)
    out = paged_prefill_attention(*p.args("csr"), backend="emulated", num_splits=num_splits)
    assert_close(out, paged_prefill_attention(*p.args()), "float16")


def test_split_plan_covers_each_tiles_keys_once():
    from pagedkv.attention import prefill_launch
    from pagedkv.attention.prefill_validation import check_paged_prefill
    from pagedkv.attention.runners import get_runner

    p = make_prefill_problem(np.random.default_rng(9), "float16", [200, 0], [1, 70], 1, 4, 64, 8)
    args = check_paged_prefill(*p.args(), None, True, "emulated")
    plan = prefill_launch.plan(get_runner("emulated"), args, 3)
    assert plan is not None
    seq, row0, split, partial = (np.asarray(a) for a in plan.metadata[4:])
    # sequence 0: 201 keys, 1 row tile, splits of 128 keys -> 2 partials; sequence 1: 70 tokens x 4
    # = 280 rows -> 5 row tiles, each needing at most 70 keys -> one split each, written directly.
    assert plan.tokens_per_split == 128
    assert seq.tolist() == [0, 0, 1, 1, 1, 1, 1]
    assert split.tolist() == [0, 1, 0, 0, 0, 0, 0]
    assert partial.tolist() == [0, 1, -1, -1, -1, -1, -1]
    assert plan.num_partials == 2 and plan.merge_grid == (1, 1, 1)
    # Longest first: 128 and 73 keys (sequence 0's splits), then sequence 1's causal tiles from
    # its last (70 keys) to its first (16 keys).
    rows = instances.PREFILL_ROWS
    assert row0.tolist() == [0, 0, 4 * rows, 3 * rows, 2 * rows, rows, 0]


def test_work_items_are_dispatched_longest_first():
    # A long causal prompt next to a short one: every item's key count, in grid order, never
    # grows (the GPU starts blocks roughly in grid order; the longest must not start last).
    from pagedkv.attention import prefill_launch
    from pagedkv.attention.prefill_validation import check_paged_prefill
    from pagedkv.attention.runners import get_runner

    p = make_prefill_problem(np.random.default_rng(11), "float16", [40, 0, 5], [300, 20, 90], 1, 2, 64, 8)
    args = check_paged_prefill(*p.args(), None, True, "emulated")
    plan = prefill_launch.plan(get_runner("emulated"), args, None)
    assert plan is not None
    seq, row0, split, _ = (np.asarray(a, dtype=np.int64) for a in plan.metadata[4:])
    kv = prefill_launch.tile_kv_needed(args.query_start_loc, args.seq_lens, seq, row0, 2, True)
    keys = np.minimum(plan.tokens_per_split, kv - split * plan.tokens_per_split)
    assert len(keys) > 10 and np.all(np.diff(keys) <= 0)
    assert keys[0] == 340 and keys[-1] < keys[0]


def test_num_splits_must_be_positive():
    p = make_prefill_problem(np.random.default_rng(10), "float16", [3], [2], 1, 1, 64, 8)
    with pytest.raises(pagedkv.InvalidArgumentError, match="num_splits"):
        paged_prefill_attention(*p.args(), backend="emulated", num_splits=0)
