"""write_kv, copy_blocks and swap_blocks through the emulated kernels, against the reference."""

from __future__ import annotations

import numpy as np
import pytest
from pagedkv.attention import copy_blocks, paged_attention, swap_blocks, write_kv
from pagedkv.attention.dtypes import nan_fill_value
from pagedkv.kernels import emulation, instances

from .conftest import KIND_DTYPES, assert_close, make_problem, needs_cxx, to_kind

pytestmark = needs_cxx

KV_SHAPES = [("float16", 128, 2), ("bfloat16", 64, 3), ("float32", 256, 1)]  # kind, head_dim, kv heads


@pytest.fixture(scope="module", autouse=True)
def built():
    wanted = [instances.write_kv(k, d) for k, d, _ in KV_SHAPES] + [instances.copy_blocks()]
    wanted += [instances.decode_for("float16", 128, 16, 4), instances.merge("float16", 128)]
    emulation.prebuild([(i.source, i.name) for i in wanted])


@pytest.mark.parametrize("kind,head_dim,num_kv_heads", KV_SHAPES)
def test_write_kv_matches_reference(kind, head_dim, num_kv_heads):
    rng = np.random.default_rng(head_dim)
    shape = (6, 8, num_kv_heads, head_dim)
    fill = nan_fill_value(kind)
    caches = [np.full(shape, fill, KIND_DTYPES[kind]) for _ in range(4)]
    k = to_kind(rng.standard_normal((7, num_kv_heads, head_dim)), kind)
    v = to_kind(rng.standard_normal((7, num_kv_heads, head_dim)), kind)
    slots = np.array([0, 47, -1, 9, 8, 33, -1], np.int64)
    write_kv(k, v, caches[0], caches[1], slots, backend="emulated")
    write_kv(k, v, caches[2], caches[3], slots, backend="numpy")
    # Bitwise, NaN slots included: the kernel writes exactly the named slots.
    assert caches[0].tobytes() == caches[2].tobytes()
    assert caches[1].tobytes() == caches[3].tobytes()


def test_write_kv_empty_batch_is_a_no_op():
    cache = np.zeros((2, 8, 1, 64), np.float16)
    empty = np.zeros((0, 1, 64), np.float16)
    write_kv(empty, empty, cache, cache.copy(), np.zeros(0, np.int64), backend="emulated")
    assert not cache.any()


@pytest.mark.parametrize("kind,head_dim,num_kv_heads", KV_SHAPES)
def test_copy_blocks_all_layers_match_reference(kind, head_dim, num_kv_heads):
    rng = np.random.default_rng(1)
    layers = 3
    shape = (9, 4, num_kv_heads, head_dim)
    k_caches = [to_kind(rng.standard_normal(shape), kind) for _ in range(layers)]
    v_caches = [to_kind(rng.standard_normal(shape), kind) for _ in range(layers)]
    ref_k = [c.copy() for c in k_caches]
    ref_v = [c.copy() for c in v_caches]
    # Includes a chain (5 -> 6 then 6 -> 7) and a repeated source: runs as two waves.
    ops = np.array([[0, 5], [1, 2], [5, 6], [6, 7], [1, 8]], np.int32)
    copy_blocks(k_caches, v_caches, ops, backend="emulated")
    copy_blocks(ref_k, ref_v, ops, backend="numpy")
    for a, b in zip([*k_caches, *v_caches], [*ref_k, *ref_v], strict=True):
        assert a.tobytes() == b.tobytes()


def test_copy_waves_split_only_on_hazards():
    from pagedkv.attention.copy_planning import copy_waves

    assert len(copy_waves(np.array([[0, 1], [0, 2], [3, 4]], np.int32))) == 1
    assert len(copy_waves(np.array([[0, 1], [1, 2]], np.int32))) == 2  # read after write
    assert len(copy_waves(np.array([[0, 1], [2, 0]], np.int32))) == 2  # write after read
    assert len(copy_waves(np.array([[0, 1], [2, 1]], np.int32))) == 2  # write after write
    assert copy_waves(np.array([[3, 3]], np.int32)) == []


@pytest.mark.parametrize("backend", ["numpy", "emulated"])
def test_swap_round_trip_is_bit_identical(backend):
    """write_kv -> swap out -> other data overwrites the device blocks -> swap in: same bits and
    the same attention output as before the swap."""
    rng = np.random.default_rng(11)
    kind, block_size, heads, head_dim = "float16", 16, 2, 128
    device = [np.full((12, block_size, heads, head_dim), np.nan, np.float16) for _ in range(2)]
    host = [np.full((10, block_size, heads, head_dim), np.nan, np.float16) for _ in range(2)]
    lens = [37, 20]
    tables = np.array([[7, 2, 3], [8, 9, -1]], np.int32)
    for b, n in enumerate(lens):
        slots = np.array(
            [tables[b, t // block_size] * block_size + t % block_size for t in range(n)], np.int64
        )
        k = to_kind(rng.standard_normal((n, heads, head_dim)), kind)
        v = to_kind(rng.standard_normal((n, heads, head_dim)), kind)
        write_kv(k, v, device[0], device[1], slots, backend=backend)
    q = to_kind(rng.standard_normal((2, heads * 4, head_dim)), kind)
    seq_lens = np.array(lens, np.int32)
    before = paged_attention(q, device[0], device[1], tables, seq_lens, backend=backend)
    saved = [d.copy() for d in device]
    # Swap out: device blocks (7, 2, 3, 8, 9) -> host (4, 0, 1, 5, 6): runs (2,3->0,1), (7..9->4..6).
    out_map = np.array([[7, 4], [2, 0], [3, 1], [8, 5], [9, 6]], np.int32)
    for d, h in zip(device, host, strict=True):
        assert swap_blocks(d, h, out_map, backend=backend) == 2
    for d in device:  # another sequence takes the freed blocks
        d[[7, 2, 3, 8, 9]] = to_kind(rng.standard_normal((5, block_size, heads, head_dim)), kind)
    # Swap in onto other device blocks: host (4, 0, 1, 5, 6) -> device (0, 10, 11, 1, 4).
    in_map = np.array([[4, 0], [0, 10], [1, 11], [5, 1], [6, 4]], np.int32)
    for h, d in zip(host, device, strict=True):
        assert swap_blocks(h, d, in_map, backend=backend) == 3
    new_tables = np.array([[0, 10, 11], [1, 4, -1]], np.int32)
    moved = {7: 0, 2: 10, 3: 11, 8: 1, 9: 4}
    for d, s in zip(device, saved, strict=True):
        for old, new in moved.items():
            assert d[new].tobytes() == s[old].tobytes()
    after = paged_attention(q, device[0], device[1], new_tables, seq_lens, backend=backend)
    assert after.tobytes() == before.tobytes()


def test_kernel_store_outside_the_caches_is_caught():
    """The harness bounds-checks vector stores: a copy whose address table points past a cache
    fails the launch instead of corrupting memory."""
    cache = np.zeros((2, 4, 1, 64), np.float16)
    kernel = emulation.get_kernel(instances.CACHE_OPS_SOURCE, instances.copy_blocks().name)
    addresses = np.array([cache.ctypes.data, cache.ctypes.data], np.int64)
    ops = np.array([[0, 2]], np.int32)  # block 2 does not exist (no launcher validation here)
    with pytest.raises(emulation.KernelLaunchError, match="out-of-bounds"):
        kernel.launch(
            (1, 1, 2),
            (instances.COPY_THREADS, 1, 1),
            [addresses, ops, np.int64(cache[0].nbytes // 16)],
            reachable=[cache],
        )


def test_emulated_paged_attention_after_copy_on_write():
    rng = np.random.default_rng(2)
    p = make_problem(rng, "float16", [20], 1, 4, 128, 16)
    blocks = p.block_tables[0, :2].copy()
    free = [b for b in range(p.k_cache.shape[0]) if b not in blocks][0]
    copy_blocks([p.k_cache], [p.v_cache], np.array([[blocks[1], free]], np.int32), backend="emulated")
    forked = p.block_tables.copy()
    forked[0, 1] = free
    out = paged_attention(p.q, p.k_cache, p.v_cache, forked, p.seq_lens, backend="emulated")
    assert_close(out, paged_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens), "float16")
