"""What the decode and prefill launchers refuse because a kernel would get it wrong silently.

- A split of the tensor-core decode kernel must start on a min(block_size, tile) boundary: at
  head_dim 128, block 16 (tile 32) and 40 tokens per split its staged page-table entries name the
  wrong blocks and the output is finite and wrong. The launcher refuses such a split
  (kernel_launch.check_decode_split), and the kernel itself writes NaN if a launch bypasses it.
- A caller's ``out`` must not share memory with q or the caches (DecodeWorkspace.run).
- A cache of 2**32 slots or more: the tensor-core kernels number slots in 32 bits.

Run through the emulated backend (the real .cu sources on the CPU).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pagedkv
import pytest
from pagedkv.attention import DecodeWorkspace, kernel_launch, paged_attention, paged_prefill_attention
from pagedkv.attention import validation as val
from pagedkv.attention.runners import get_runner
from pagedkv.kernels import emulation, instances

from .conftest import assert_close, make_problem, needs_cxx

pytestmark = needs_cxx

KIND, HEAD_DIM, BLOCK, GROUP = "float16", 128, 16, 4  # tensor cores by default; tile 32


@pytest.fixture(scope="module", autouse=True)
def built():
    names = [
        instances.decode_for(KIND, HEAD_DIM, BLOCK, GROUP),
        instances.decode_for(KIND, HEAD_DIM, BLOCK, GROUP, use_tensor_cores=False),
        instances.merge(KIND, HEAD_DIM),
    ]
    emulation.prebuild([(i.source, i.name) for i in names])


def _problem():
    return make_problem(np.random.default_rng(39), KIND, [100], 1, GROUP, HEAD_DIM, BLOCK)


def _launch(p, tokens_per_split: int, use_tensor_cores: bool | None = None, bypass: bool = False):
    """One decode launch with a split size of our choosing (the planner never picks a bad one):
    through launch_decode, or (bypass) straight to the runner as a caller skipping it would."""
    runner = get_runner("emulated")
    shape = val.check_paged_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, None, "emulated")
    shape = dataclasses.replace(shape, use_tensor_cores=use_tensor_cores)
    splits = -(-int(p.seq_lens.max()) // tokens_per_split)
    out = np.zeros_like(p.q)
    part = (shape.num_seqs, shape.num_q_heads, splits)
    split_out = np.zeros((*part, HEAD_DIM), np.float32)
    buffers = (split_out, np.zeros(part, np.float32), np.zeros(part, np.float32))
    table_stride = int(p.block_tables.shape[1])
    if not bypass:
        kernel_launch.launch_decode(
            runner, out, buffers, p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, shape,
            table_stride, splits, tokens_per_split,
        )  # fmt: skip
        return out
    runner.launch(
        kernel_launch.decode_instance(shape),
        (shape.num_kv_heads, shape.num_seqs, splits),
        (instances.DECODE_MMA_THREADS, 1, 1),
        [
            out, *buffers, p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens,
            np.int32(shape.num_kv_heads), np.int32(shape.group), np.int32(table_stride),
            np.int32(tokens_per_split), np.float32(shape.scale * kernel_launch.LOG2E), np.int32(0),
        ],
    )  # fmt: skip
    if splits > 1:
        runner.launch(
            instances.merge(KIND, HEAD_DIM),
            (shape.num_q_heads, shape.num_seqs, 1),
            (instances.MERGE_THREADS, 1, 1),
            [out, *buffers, np.int32(splits)],
        )
    return out


def _reference(p):
    return paged_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens)


@pytest.mark.parametrize("use_tensor_cores", [None, False])
def test_a_split_off_the_block_boundary_is_refused(use_tensor_cores):
    p = _problem()
    # 40 = 2.5 blocks: the reported case. Refused for both kernels (one rule for every launch).
    with pytest.raises(pagedkv.InvalidArgumentError, match="multiple of 16"):
        _launch(p, 40, use_tensor_cores)
    for bad in (0, -16):
        with pytest.raises(pagedkv.InvalidArgumentError, match="positive multiple"):
            kernel_launch.check_decode_split(
                val.AttentionShape(1, 4, 1, HEAD_DIM, BLOCK, 8, 8, GROUP, KIND, 1.0, 100), 1, bad
            )
    # A whole block that is not a whole tile is fine (the rule is min(block, tile)).
    assert_close(_launch(p, 48, use_tensor_cores), _reference(p), KIND)


def test_a_launch_bypassing_the_launcher_gets_nan_not_a_wrong_answer():
    p = _problem()
    for tokens_per_split in (40, 100):  # 3 splits (merged) and 1 split
        out = _launch(p, tokens_per_split, bypass=True)
        assert np.isnan(out.astype(np.float32)).all(), tokens_per_split


def test_splits_that_do_not_cover_the_longest_sequence_are_refused():
    shape = val.AttentionShape(1, 4, 1, HEAD_DIM, BLOCK, 8, 8, GROUP, KIND, 1.0, 100)
    kernel_launch.check_decode_split(shape, 4, 32)  # 128 >= 100
    with pytest.raises(pagedkv.InvalidArgumentError, match="do not cover"):
        kernel_launch.check_decode_split(shape, 3, 32)  # 96 < 100: the last 4 keys would be dropped
    with pytest.raises(pagedkv.InvalidArgumentError, match="num_splits"):
        kernel_launch.check_decode_split(shape, instances.MAX_SPLITS + 1, 32)
    # With a window the visible span is the window plus the tile's rounding, not the context.
    windowed = dataclasses.replace(shape, max_seq_len=10_000)
    kernel_launch.check_decode_split(windowed, 1, 64, window=33)  # 64 >= 33 + 32 - 1


def _workspace(p, backend: str = "emulated") -> DecodeWorkspace:
    return DecodeWorkspace(
        num_blocks=int(p.k_cache.shape[0]),
        block_size=BLOCK,
        num_kv_heads=1,
        num_q_heads=GROUP,
        head_dim=HEAD_DIM,
        dtype=np.float16,
        max_num_seqs=1,
        max_blocks_per_seq=int(p.block_tables.shape[1]),
        backend=backend,
    )


def test_workspace_out_must_not_alias_q_or_the_caches():
    p = _problem()
    ws = _workspace(p)
    ws.plan(p.block_tables, p.seq_lens)
    q_copy = p.q.copy()
    in_k = p.k_cache.reshape(-1)[: p.q.size].reshape(p.q.shape)
    in_v = p.v_cache.reshape(-1)[HEAD_DIM * 8 : HEAD_DIM * 8 + p.q.size].reshape(p.q.shape)
    for out, name in ((p.q, "q"), (in_k, "k_cache"), (in_v, "v_cache")):
        with pytest.raises(pagedkv.InvalidArgumentError, match=f"overlaps {name}"):
            ws.run(p.q, p.k_cache, p.v_cache, out=out)
    np.testing.assert_array_equal(p.q, q_copy)  # nothing ran
    # A separate buffer, even one right next to q in the same allocation, is accepted.
    pool = np.empty((2, *p.q.shape), np.float16)
    pool[0] = p.q
    assert_close(ws.run(pool[0], p.k_cache, p.v_cache, out=pool[1]), _reference(p), KIND)


def test_caches_of_two_to_the_32_slots_are_refused():
    p = _problem()
    # Shapes only: a zero-stride view stands for a cache too large to allocate.
    for num_blocks, block in ((1 << 28, 16), (1 << 32, 1)):
        huge = np.lib.stride_tricks.as_strided(p.k_cache, (num_blocks, block, 1, HEAD_DIM), (0, 0, 0, 2))
        with pytest.raises(pagedkv.InvalidArgumentError, match="32-bit slot"):
            paged_attention(p.q, huge, huge, p.block_tables, p.seq_lens, backend="emulated")
        q = p.q[0][None]
        with pytest.raises(pagedkv.InvalidArgumentError, match="32-bit slot"):
            paged_prefill_attention(
                q, huge, huge, p.block_tables, p.seq_lens, np.array([0, 1], np.int32), backend="emulated"
            )
    with pytest.raises(pagedkv.InvalidArgumentError, match="32-bit slot"):
        DecodeWorkspace(
            num_blocks=1 << 28, block_size=16, num_kv_heads=1, num_q_heads=4, head_dim=HEAD_DIM,
            dtype=np.float16, max_num_seqs=1, max_blocks_per_seq=1, backend="emulated",
        )  # fmt: skip
    val.check_slot_count((1 << 28) - 1, 16)  # 2**32 - 16 slots: addressable
    val.check_slot_count((1 << 32) - 1, 1)
    # The NumPy reference has no such limit: its checks stop at the contiguity it needs.
    huge = np.lib.stride_tricks.as_strided(p.k_cache, (1 << 28, 16, 1, HEAD_DIM), (0, 0, 0, 2))
    with pytest.raises(pagedkv.InvalidArgumentError, match="C-contiguous"):
        paged_attention(p.q, huge, huge, p.block_tables, p.seq_lens)
