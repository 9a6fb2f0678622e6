"""The cuda backend on a real GPU against the NumPy reference (skipped without CuPy and a GPU)."""

from __future__ import annotations

import itertools

import numpy as np
import pagedkv
import pytest
from pagedkv.attention import contiguous_attention, copy_blocks, paged_attention, swap_blocks, write_kv
from pagedkv.kernels import instances

from .conftest import KIND_DTYPES, assert_close, cupy_and_gpu_marks, make_problem, stable_seed, to_kind
from .prefill_problems import make_prefill_problem
from .window_problems import poison_before_window, release_decode_blocks, release_out_of_window

cupy, pytestmark = cupy_and_gpu_marks("backend='cuda' needs CuPy")


def _to_device(p):
    return [cupy.asarray(x) for x in (p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens)]


GRID = list(
    itertools.product(instances.KERNEL_TYPES, instances.HEAD_DIMS, instances.BLOCK_SIZES, (1, 3, 4, 8))
)


@pytest.mark.parametrize("kind,head_dim,block_size,group", GRID)
def test_decode_matches_reference_every_instance(kind, head_dim, block_size, group):
    rng = np.random.default_rng(stable_seed(kind, head_dim, block_size, group))
    p = make_problem(rng, kind, [1, 77, 300, 16 * block_size], 2, group, head_dim, block_size)
    expected = paged_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens)
    for splits in (None, 1, 5):
        out = paged_attention(*_to_device(p), backend="cuda", num_splits=splits)
        assert_close(cupy.asnumpy(out), expected, kind)


@pytest.mark.parametrize("kind,group", list(itertools.product(instances.DECODE_MMA_KINDS, (3, 4, 8))))
def test_cuda_core_decode_on_tensor_core_shapes(kind, group):
    """use_tensor_cores=False: the CUDA-core kernel where the launcher would pick tensor cores (the
    benchmark's baseline; head dim 128, block 16, as gpu_decode.py's sweep), both paths checked."""
    rng = np.random.default_rng(stable_seed("cuda-core", kind, group))
    p = make_problem(rng, kind, [1, 77, 300, 700], 2, group, 128, 16)
    expected = paged_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens)
    for use in (False, True):
        for splits in (None, 1, 5):
            out = paged_attention(*_to_device(p), backend="cuda", num_splits=splits, use_tensor_cores=use)
            assert_close(cupy.asnumpy(out), expected, kind)


@pytest.mark.parametrize("kind,head_dim,block_size,group", GRID)
def test_windowed_decode_every_instance(kind, head_dim, block_size, group):
    """window=: released blocks are NaN with table entry -1, the slots before the window NaN;
    windows below a block, not a multiple of it, and above the context; host and device tables."""
    for window in (3, 37, 1000):
        rng = np.random.default_rng(stable_seed("window", kind, head_dim, block_size, group, window))
        lens = [1, 77, 300, 16 * block_size]
        p = make_prefill_problem(rng, kind, [n - 1 for n in lens], [1] * 4, 2, group, head_dim, block_size)
        release_out_of_window(p, window)
        pk = p.paged
        expected = paged_attention(p.q, pk.k_cache, pk.v_cache, pk.block_tables, p.seq_lens, window=window)
        poison_before_window(p, window)
        q, k, v = (cupy.asarray(x) for x in (p.q, pk.k_cache, pk.v_cache))
        for tables, lens_arg in (
            (pk.block_tables, p.seq_lens),
            (cupy.asarray(pk.block_tables), cupy.asarray(p.seq_lens)),
        ):
            for splits in (None, 1, 5):
                out = paged_attention(
                    q, k, v, tables, lens_arg, backend="cuda", num_splits=splits, window=window
                )
                assert_close(cupy.asnumpy(out), expected, kind)


def test_windowed_workspace_replays_in_a_cuda_graph_as_blocks_are_released():
    """DecodeWorkspace(window=): a 64-sequence step captured once, replayed after the next step's
    plan, when lengths grew by 5 and the sliding-window group released the blocks that slid out
    (NaN, -1); the window is the kernel's scalar argument, frozen in the graph with the workspace."""
    from pagedkv.attention import DecodeWorkspace

    window = 100
    rng = np.random.default_rng(stable_seed("windowed-workspace"))
    lens = [int(n) for n in rng.integers(6, 600, size=64)]
    p = make_prefill_problem(rng, "bfloat16", [n - 1 for n in lens], [1] * 64, 2, 4, 128, 16)
    pk = p.paged
    later = p.seq_lens
    earlier = (later - 5).astype(np.int32)
    expected = [
        paged_attention(p.q, pk.k_cache, pk.v_cache, pk.block_tables, n, window=window)
        for n in (earlier, later)
    ]
    ws = DecodeWorkspace(
        num_blocks=pk.k_cache.shape[0],
        block_size=16,
        num_kv_heads=2,
        num_q_heads=8,
        head_dim=128,
        dtype=p.q.dtype,
        max_num_seqs=64,
        max_blocks_per_seq=pk.block_tables.shape[1],
        backend="cuda",
        window=window,
    )
    release_decode_blocks(p, earlier, window)
    q, k, v = (cupy.asarray(x) for x in (p.q, pk.k_cache, pk.v_cache))
    out = cupy.empty_like(q)
    first = ws.plan(pk.block_tables, earlier, num_splits=3)
    ws.run(q, k, v, out=out)  # loads the kernels outside the capture
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        ws.run(q, k, v, out=out)
        graph = stream.end_capture()
        out.fill(0)
        graph.launch(stream)
        stream.synchronize()
        assert_close(cupy.asnumpy(out), expected[0], "bfloat16")
        release_decode_blocks(p, later, window)
        k.set(pk.k_cache)
        v.set(pk.v_cache)
        assert ws.plan(pk.block_tables, later, num_splits=3).graph_key == first.graph_key
        graph.launch(stream)
        stream.synchronize()
        assert_close(cupy.asnumpy(out), expected[1], "bfloat16")


def test_long_context_auto_split():
    rng = np.random.default_rng(9)
    p = make_problem(rng, "bfloat16", [4000, 9000], 1, 8, 128, 16)
    out = paged_attention(*_to_device(p), backend="cuda")
    assert_close(
        cupy.asnumpy(out), paged_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens), "bfloat16"
    )


def test_contiguous_on_gpu():
    rng = np.random.default_rng(2)
    q, k, v = (to_kind(rng.standard_normal(s), "float16") for s in ((8, 128), (99, 2, 128), (99, 2, 128)))
    out = contiguous_attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), backend="cuda")
    assert_close(cupy.asnumpy(out), contiguous_attention(q, k, v), "float16")


@pytest.mark.parametrize("kind", list(instances.KERNEL_TYPES))
def test_write_and_copy_blocks_bitwise(kind):
    rng = np.random.default_rng(3)
    shape = (10, 16, 2, 128)
    host = [to_kind(rng.standard_normal(shape), kind) for _ in range(4)]
    dev = [cupy.asarray(h) for h in host]
    k = to_kind(rng.standard_normal((5, 2, 128)), kind)
    v = to_kind(rng.standard_normal((5, 2, 128)), kind)
    slots = np.array([3, 160 - 1, -1, 40, 41], np.int64)
    write_kv(cupy.asarray(k), cupy.asarray(v), dev[0], dev[1], cupy.asarray(slots), backend="cuda")
    write_kv(k, v, host[0], host[1], slots)
    ops = np.array([[0, 4], [4, 5], [1, 9]], np.int32)
    copy_blocks(dev[:2], dev[2:], ops, backend="cuda")
    copy_blocks(host[:2], host[2:], ops)
    for d, h in zip(dev, host, strict=True):
        assert cupy.asnumpy(d).tobytes() == h.tobytes()


def test_swap_with_pinned_host_memory():
    import cupyx

    rng = np.random.default_rng(4)
    device = cupy.asarray(to_kind(rng.standard_normal((8, 16, 2, 128)), "float16"))
    host = cupyx.empty_pinned((6, 16, 2, 128), dtype=np.float16)
    out_map = np.array([[2, 0], [3, 1], [7, 4]], np.int32)
    assert swap_blocks(device, host, out_map, backend="cuda") == 2
    cupy.cuda.get_current_stream().synchronize()
    expected = cupy.asnumpy(device)
    for s, d in out_map:
        assert host[d].tobytes() == expected[s].tobytes()
    device[:] = 0
    assert swap_blocks(host, device, out_map[:, ::-1].copy(), backend="cuda") == 2
    cupy.cuda.get_current_stream().synchronize()
    for s, _ in out_map:
        assert cupy.asnumpy(device[s]).tobytes() == expected[s].tobytes()


def test_pageable_host_memory_is_rejected():
    device = cupy.zeros((2, 16, 1, 64), dtype=np.float16)
    with pytest.raises(pagedkv.InvalidArgumentError, match="pinned"):
        swap_blocks(
            device, np.zeros((2, 16, 1, 64), np.float16), np.array([[0, 0]], np.int32), backend="cuda"
        )


def test_dtype_table_is_consistent():
    assert set(instances.KERNEL_TYPES) <= set(KIND_DTYPES)


def test_host_metadata_path_matches_reference():
    rng = np.random.default_rng(10)
    p = make_problem(rng, "float16", [1, 300, 1000], 2, 8, 128, 16)
    q, k, v = (cupy.asarray(x) for x in (p.q, p.k_cache, p.v_cache))
    out = paged_attention(q, k, v, p.block_tables, p.seq_lens, backend="cuda")
    assert_close(
        cupy.asnumpy(out), paged_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens), "float16"
    )


def test_workspace_step_of_64_sequences_replays_in_a_cuda_graph():
    """The graph-capture target: a 64-sequence decode step captured once, replayed after a re-plan."""
    from pagedkv.attention import DecodeWorkspace

    rng = np.random.default_rng(11)
    lens = [int(n) for n in rng.integers(1, 600, size=64)]
    p = make_problem(rng, "bfloat16", lens, 2, 4, 128, 16)
    ws = DecodeWorkspace(
        num_blocks=p.k_cache.shape[0],
        block_size=16,
        num_kv_heads=2,
        num_q_heads=8,
        head_dim=128,
        dtype=p.q.dtype,
        max_num_seqs=64,
        max_blocks_per_seq=p.block_tables.shape[1],
        backend="cuda",
    )
    q, k, v = (cupy.asarray(x) for x in (p.q, p.k_cache, p.v_cache))
    out = cupy.empty_like(q)
    first = ws.plan(p.block_tables, p.seq_lens, num_splits=3)
    ws.run(q, k, v, out=out)  # loads the kernels outside the capture
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        ws.run(q, k, v, out=out)
        graph = stream.end_capture()
        out.fill(0)
        graph.launch(stream)
        stream.synchronize()
        expected = paged_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens)
        assert_close(cupy.asnumpy(out), expected, "bfloat16")
        # New lengths, same split count: the graph reads the re-planned buffers.
        shorter = np.maximum(p.seq_lens - 5, 0).astype(np.int32)
        assert ws.plan(p.block_tables, shorter, num_splits=3).graph_key == first.graph_key
        graph.launch(stream)
        stream.synchronize()
        expected = paged_attention(p.q, p.k_cache, p.v_cache, p.block_tables, shorter)
        assert_close(cupy.asnumpy(out), expected, "bfloat16")
