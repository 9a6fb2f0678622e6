"""The decode host path: validation on host metadata, no device-to-host sync, DecodeWorkspace.

The cuda backend runs here on a stand-in for CuPy (tests/kernels/fake_cupy.py) that raises on
every read of device memory from the host, with kernels in the CPU emulation: a call that passes
made no sync and computed the right answer.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pagedkv
import pytest
from pagedkv.attention import DecodeWorkspace, paged_attention, runners
from pagedkv.kernels import emulation, instances

from . import fake_cupy
from .conftest import assert_close, make_problem, needs_cxx
from .prefill_problems import make_prefill_problem
from .window_problems import poison_before_window, release_decode_blocks, release_out_of_window

pytestmark = needs_cxx


@pytest.fixture(scope="module", autouse=True)
def built():
    names = [
        instances.decode_for("float16", 128, 16, 4),
        instances.decode_for("float16", 128, 16, 8),
        instances.decode_for("float16", 128, 16, 1),  # CUDA cores (test_emulated_window builds it too)
        instances.merge("float16", 128),
    ]
    emulation.prebuild([(i.source, i.name) for i in names])


@pytest.fixture
def fake_cuda(monkeypatch):
    runner = fake_cupy.FakeCudaRunner()
    monkeypatch.setattr(runners, "_cuda", runner)
    fake_cupy.Counters.reset()
    return runner


def _reference(p):
    return paged_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens)


@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_cuda_call_with_host_metadata_makes_no_sync(fake_cuda, num_splits):
    p = make_problem(np.random.default_rng(11), "float16", [40, 7, 90], 2, 4, 128, 16)
    q, k, v = fake_cupy.to_device(p.q, p.k_cache, p.v_cache)
    out = paged_attention(q, k, v, p.block_tables, p.seq_lens, backend="cuda", num_splits=num_splits)
    assert_close(fake_cupy.to_host(out), _reference(p), "float16")
    assert fake_cupy.Counters.launches >= 1


def test_cuda_call_with_device_metadata_syncs(fake_cuda):
    """The stand-in catches syncs: device tables are checked on the device and read back."""
    p = make_problem(np.random.default_rng(12), "float16", [40, 7], 2, 4, 128, 16)
    args = fake_cupy.to_device(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens)
    with pytest.raises(fake_cupy.SyncError):
        paged_attention(*args, backend="cuda")


def test_cuda_call_rejects_bad_host_metadata_before_launching(fake_cuda):
    p = make_problem(np.random.default_rng(13), "float16", [40, 7], 2, 4, 128, 16)
    q, k, v = fake_cupy.to_device(p.q, p.k_cache, p.v_cache)
    tables = p.block_tables.copy()
    tables[0, 1] = p.k_cache.shape[0]
    with pytest.raises(pagedkv.InvalidArgumentError, match=r"block_tables\[0, 1\]"):
        paged_attention(q, k, v, tables, p.seq_lens, backend="cuda")
    with pytest.raises(pagedkv.InvalidArgumentError, match="both be NumPy or both be CuPy"):
        paged_attention(q, k, v, tables, fake_cupy.to_device(p.seq_lens)[0], backend="cuda")
    assert fake_cupy.Counters.launches == 0


def _workspace(p, backend, **kw):
    num_blocks, block_size, heads, head_dim = p.k_cache.shape
    return DecodeWorkspace(
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=heads,
        num_q_heads=p.q.shape[1],
        head_dim=head_dim,
        dtype=p.q.dtype,
        max_num_seqs=kw.pop("max_num_seqs", 4),
        max_blocks_per_seq=kw.pop("max_blocks_per_seq", 12),
        backend=backend,
        split_bytes=kw.pop("split_bytes", 1 << 20),
        **kw,
    )


def test_workspace_run_allocates_nothing_and_never_syncs(fake_cuda):
    rng = np.random.default_rng(14)
    p = make_problem(rng, "float16", [100, 33, 5], 1, 8, 128, 16, spare_blocks=6)
    ws = _workspace(p, "cuda")
    q, k, v = fake_cupy.to_device(p.q, p.k_cache, p.v_cache)
    out = fake_cupy.FakeArray(np.empty_like(p.q))
    for splits in (1, 4, None):
        plan = ws.plan(p.block_tables, p.seq_lens, num_splits=splits)
        assert plan.num_seqs == 3 and plan.max_seq_len == 100
        fake_cupy.Counters.reset()
        for _ in range(2):  # a replayed step reads the same buffers
            assert ws.run(q, k, v, out=out) is out
        assert fake_cupy.Counters.allocations == 0 and fake_cupy.Counters.uploads == 0
        assert fake_cupy.Counters.event_waits == 0
        assert fake_cupy.Counters.launches == 2 * (1 if plan.num_splits == 1 else 2)
        assert_close(fake_cupy.to_host(out), _reference(p), "float16")


def test_workspace_plan_is_one_upload_pair_and_waits_only_to_reuse_staging(fake_cuda):
    p = make_problem(np.random.default_rng(15), "float16", [20, 64], 1, 4, 128, 16)
    ws = _workspace(p, "cuda")
    for step in range(4):
        fake_cupy.Counters.reset()
        ws.plan(p.block_tables, p.seq_lens)
        assert fake_cupy.Counters.uploads == 2 and fake_cupy.Counters.allocations == 0
        # Two staging buffers in turn: a plan waits for the upload two plans back, none before.
        assert fake_cupy.Counters.event_waits == (1 if step >= 2 else 0)


def test_workspace_emulated_matches_reference_across_replans():
    rng = np.random.default_rng(16)
    big = make_problem(rng, "float16", [150, 3, 64, 17], 2, 4, 128, 16, spare_blocks=4)
    ws = _workspace(big, "emulated", max_blocks_per_seq=16)
    for splits in (None, 1, 5):
        ws.plan(big.block_tables, big.seq_lens, num_splits=splits)
        assert_close(ws.run(big.q, big.k_cache, big.v_cache), _reference(big), "float16")
    # A smaller, narrower batch on the same caches: stale rows and columns must not matter.
    small_lens = np.array([30, 1], np.int32)
    tables = big.block_tables[[0, 2], :2].copy()
    q = np.ascontiguousarray(big.q[[0, 2]])
    ws.plan(tables, small_lens, num_splits=2)
    out = np.empty_like(q)
    assert ws.run(q, big.k_cache, big.v_cache, out=out) is out
    expected = paged_attention(q, big.k_cache, big.v_cache, tables, small_lens)
    assert_close(out, expected, "float16")


def test_workspace_split_count_is_capped_by_its_buffers():
    p = make_problem(np.random.default_rng(17), "float16", [150, 150], 1, 4, 128, 16)
    per_split = 2 * 4 * (128 + 2) * 4  # bytes of one split of the whole batch
    ws = _workspace(p, "emulated", split_bytes=3 * per_split)
    assert ws.max_splits(2) == 3
    plan = ws.plan(p.block_tables, p.seq_lens, num_splits=50)
    assert plan.num_splits <= 3
    assert_close(ws.run(p.q, p.k_cache, p.v_cache), _reference(p), "float16")


def test_workspace_rejects_bad_input():
    p = make_problem(np.random.default_rng(18), "float16", [40, 7], 2, 4, 128, 16)
    ws = _workspace(p, "emulated")
    with pytest.raises(pagedkv.InvalidArgumentError, match="before plan"):
        ws.run(p.q, p.k_cache, p.v_cache)
    bad = p.block_tables.copy()
    bad[1, 0] = -1
    cases = [
        ((bad, p.seq_lens), r"block_tables\[1, 0\]"),
        ((np.ma.masked_array(p.block_tables), p.seq_lens), "masked"),
        ((p.block_tables.astype(np.int64), p.seq_lens), "int32"),
        ((p.block_tables, p.seq_lens.tolist()), "NumPy"),
        ((np.zeros((5, 2), np.int32), np.zeros(5, np.int32)), "exceeds the workspace"),
        ((p.block_tables, np.array([40, 7000], np.int32)), "seq_lens must lie"),
    ]
    for args, match in cases:
        with pytest.raises(pagedkv.InvalidArgumentError, match=match):
            ws.plan(*args)
    ws.plan(p.block_tables, p.seq_lens)
    with pytest.raises(pagedkv.InvalidArgumentError, match="sequences"):
        ws.run(p.q[:1].copy(), p.k_cache, p.v_cache)
    with pytest.raises(pagedkv.InvalidArgumentError, match="workspace"):
        ws.run(p.q, p.k_cache[:-1].copy(), p.v_cache[:-1].copy())
    with pytest.raises(pagedkv.InvalidArgumentError, match="out must be"):
        ws.run(p.q, p.k_cache, p.v_cache, out=np.empty(p.q.shape, np.float32))
    with pytest.raises(pagedkv.InvalidArgumentError, match="positive integer"):
        DecodeWorkspace(
            num_blocks=0,
            block_size=16,
            num_kv_heads=1,
            num_q_heads=1,
            head_dim=128,
            dtype=np.float16,
            max_num_seqs=1,
            max_blocks_per_seq=1,
            backend="emulated",
        )


# Sliding windows: DecodeWorkspace(window=W) against paged_attention(window=W) and the reference.


def _windowed(seed, group, window, seq_lens=(70, 9, 40)):
    """A decode batch (fp16, head_dim 128, block 16, one KV head) with what a sliding-window KV
    group releases: blocks wholly before each window NaN, their table entries -1."""
    p = make_prefill_problem(
        np.random.default_rng(seed),
        "float16",
        [n - 1 for n in seq_lens],
        [1] * len(seq_lens),
        1,
        group,
        128,
        16,
    )
    release_out_of_window(p, window)
    return p


def _windowed_workspace(p, backend, window, **kw):
    return _workspace(p.paged, backend, window=window, max_blocks_per_seq=p.paged.block_tables.shape[1], **kw)


def _decode(p, window, backend="numpy", **kw):
    paged = p.paged
    return paged_attention(
        p.q,
        paged.k_cache,
        paged.v_cache,
        paged.block_tables,
        p.seq_lens,
        window=window,
        backend=backend,
        **kw,
    )


@pytest.mark.parametrize(
    ("group", "windows"),
    [(4, (3, 37)), (1, (13, 500))],  # tensor cores; CUDA cores
    ids=["tensor-cores", "cuda-cores"],
)
def test_workspace_window_matches_paged_attention_and_reference(group, windows):
    """Windows below a block, not a multiple of it, above every context. Released blocks are NaN
    with -1 entries, then every slot before each window is NaN too: a kernel that reads a key
    before the window (or a -1 entry: the emulation's bounds check) fails."""
    for window in windows:
        p = _windowed(window, group, window)
        ref = _decode(p, window)
        poison_before_window(p, window)
        ws = _windowed_workspace(p, "emulated", window)
        for splits in (None, 2):
            plan = ws.plan(p.paged.block_tables, p.seq_lens, num_splits=splits)
            assert plan.window == window and plan.max_seq_len == 70
            out = ws.run(p.q, p.paged.k_cache, p.paged.v_cache)
            # The same kernel, splits and window as the per-call API: the same bits.
            expected = _decode(p, window, "emulated", num_splits=plan.num_splits)
            np.testing.assert_array_equal(out, expected)
            assert_close(out, ref, "float16")


def test_workspace_window_replans_as_blocks_are_released():
    """Two decode steps of one workspace, as an engine runs them: lengths grow by 5 tokens and the
    sliding-window group releases the blocks that slid out in between (NaN, -1). The graph key
    stays (fixed split count, the same visible span), so a captured run could be replayed."""
    window = 20
    p = _windowed(6, 4, 1000)  # nothing released yet (the window below is smaller)
    tables, lens = p.paged.block_tables, p.seq_lens
    earlier = (lens - 5).astype(np.int32)
    kv = (p.paged.k_cache, p.paged.v_cache)
    expected = [paged_attention(p.q, *kv, tables, n, window=window) for n in (earlier, lens)]
    ws = _windowed_workspace(p, "emulated", window)
    keys = []
    for step, step_lens in enumerate((earlier, lens)):
        release_decode_blocks(p, step_lens, window)
        plan = ws.plan(tables, step_lens, num_splits=2)
        keys.append(plan.graph_key)
        assert_close(ws.run(p.q, *kv), expected[step], "float16")
    assert keys[0] == keys[1]
    # The earlier step's lengths now reach into released blocks: refused.
    with pytest.raises(pagedkv.InvalidArgumentError, match="= -1"):
        ws.plan(tables, earlier)


def test_workspace_window_plans_splits_over_the_visible_keys_only():
    """A 1000-token context under a 16-key window plans like 16 + tile - 1 keys: one split, where
    the whole context splits on the emulated runner's 2 SMs (plan only: no launch)."""
    p = _windowed(1, 4, 16, seq_lens=(1000,))
    tables, lens = p.paged.block_tables, p.seq_lens
    full = _workspace(p.paged, "emulated", max_blocks_per_seq=tables.shape[1])
    full_plan = full.plan(
        make_problem(np.random.default_rng(2), "float16", [1000], 1, 4, 128, 16).block_tables, lens
    )
    windowed = _windowed_workspace(p, "emulated", 16).plan(tables, lens)
    tile = instances.tile_tokens("float16", 128)
    assert full_plan.num_splits > 1 and windowed.num_splits == 1
    assert windowed.tokens_per_split >= 16 + tile - 1 and windowed.tokens_per_split < 1000
    # A forced split count cuts the visible keys, not the context.
    forced = _windowed_workspace(p, "emulated", 16).plan(tables, lens, num_splits=2)
    assert forced.num_splits == 2 and forced.tokens_per_split == tile


def test_workspace_window_on_cuda_makes_no_sync(fake_cuda):
    window = 20
    p = _windowed(3, 4, window)
    ref = _decode(p, window)
    poison_before_window(p, window)
    ws = _windowed_workspace(p, "cuda", window)
    q, k, v = fake_cupy.to_device(p.q, p.paged.k_cache, p.paged.v_cache)
    out = fake_cupy.FakeArray(np.empty_like(p.q))
    ws.plan(p.paged.block_tables, p.seq_lens, num_splits=2)
    fake_cupy.Counters.reset()
    assert ws.run(q, k, v, out=out) is out
    assert fake_cupy.Counters.allocations == 0 and fake_cupy.Counters.uploads == 0
    assert_close(fake_cupy.to_host(out), ref, "float16")


def test_workspace_window_validation():
    window = 37  # seq 70: first visible key 33, so blocks 0-1 are released and block 2 is partly visible
    p = _windowed(4, 4, window)
    tables, lens = p.paged.block_tables, p.seq_lens
    assert (tables[0, :2] == -1).all() and tables[0, 2] >= 0
    ws = _windowed_workspace(p, "emulated", window)
    ws.plan(tables, lens)  # -1 at released positions is accepted
    # Without a window the same tables read the released blocks: refused.
    with pytest.raises(pagedkv.InvalidArgumentError, match=r"block_tables\[0, 0\] = -1"):
        _windowed_workspace(p, "emulated", None).plan(tables, lens)
    # -1 in a block the window reads (partly or wholly) is refused, and the last plan stays.
    before = ws.current_plan
    for b, i in ((0, 2), (0, 4), (1, 0), (2, 1)):
        bad = tables.copy()
        bad[b, i] = -1
        with pytest.raises(pagedkv.InvalidArgumentError, match=rf"block_tables\[{b}, {i}\] = -1"):
            ws.plan(bad, lens)
        assert ws.current_plan is before
    # Windows as paged_attention takes them: a positive int or None; a window above any context
    # (even one past int64) means all keys.
    for bad_window, match in (
        (0, ">= 1"),
        (-1, ">= 1"),
        (True, "positive int"),
        (np.bool_(False), "positive int"),
        (2.5, "positive int"),
        ("3", "positive int"),
    ):
        with pytest.raises(pagedkv.InvalidArgumentError, match=match):
            _windowed_workspace(p, "emulated", bad_window)
        with pytest.raises(pagedkv.InvalidArgumentError, match=match):
            _decode(p, bad_window)
    full = make_problem(np.random.default_rng(5), "float16", [70, 9, 40], 1, 4, 128, 16)
    unwindowed = _workspace(full, "emulated").plan(full.block_tables, full.seq_lens)
    for huge in (71, 1 << 40, 2**70, np.int64(2**62)):
        huge_ws = _workspace(full, "emulated", window=huge)
        assert replace(huge_ws.plan(full.block_tables, full.seq_lens), window=None) == unwindowed
        np.testing.assert_array_equal(
            paged_attention(
                full.q, full.k_cache, full.v_cache, full.block_tables, full.seq_lens, window=huge
            ),
            _reference(full),
        )
    assert_close(huge_ws.run(full.q, full.k_cache, full.v_cache), _reference(full), "float16")
