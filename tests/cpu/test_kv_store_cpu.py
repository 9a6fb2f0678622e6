"""The engine's KV store on the CPU data plane: the default, the same slots as the per-sequence
formula, attention within the stated tolerance of the NumPy data plane, and copies and swaps
identical."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedkv.engine.kv_store import PagedKvStore, default_backend

CONFIG: Any = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=16, num_q_heads=4)


def test_cpu_is_the_default_and_the_env_selects_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDKV_DATA_PLANE", raising=False)
    assert default_backend() == "cpu" and PagedKvStore(CONFIG, 4, 4).backend == "cpu"
    monkeypatch.setenv("PAGEDKV_DATA_PLANE", "numpy")
    assert PagedKvStore(CONFIG, 4, 4).backend == "numpy"
    monkeypatch.setenv("PAGEDKV_DATA_PLANE", "cuda")
    with pytest.raises(ValueError):
        default_backend()


@settings(max_examples=30)
@given(
    st.lists(st.tuples(st.integers(1, 20), st.integers(1, 6)), min_size=1, max_size=4), st.integers(0, 2**31)
)
def test_cpu_store_matches_numpy_store(seqs: list[tuple[int, int]], seed: int) -> None:
    rng = np.random.default_rng(seed)
    bs = 4
    ctx = np.array([n for n, _ in seqs], np.int32)
    q_lens = np.array([min(q, n) for n, q in seqs], np.int32)
    per_seq = -(-int(ctx.max()) // bs)
    num_blocks = len(seqs) * per_seq + 1
    tables = (
        rng.permutation(num_blocks - 1)[: len(seqs) * per_seq].astype(np.int32).reshape(len(seqs), per_seq)
    )
    stores = [PagedKvStore(CONFIG, num_blocks, bs, backend=b) for b in ("numpy", "cpu")]
    for s in stores:
        s.set_batch(tables, ctx, q_lens)
    # Slots: the per-sequence formula the store used to loop over.
    want = np.concatenate(
        [
            tables[b, p // bs].astype(np.int64) * bs + p % bs
            for b in range(len(seqs))
            for p in [np.arange(ctx[b] - q_lens[b], ctx[b])]
        ]
    )
    assert all(np.array_equal(s._slots[0], want) for s in stores)  # one KV group: group 0
    # Earlier positions' K/V, then one attend per layer on both stores.
    for s in stores:
        for layer in range(CONFIG.num_layers):
            s.k_caches[layer][:] = (
                rng.uniform(-1, 1, s.k_caches[layer].shape).astype(np.float32)
                if s is stores[0]
                else stores[0].k_caches[layer]
            )
            s.v_caches[layer][:] = (
                rng.uniform(-1, 1, s.v_caches[layer].shape).astype(np.float32)
                if s is stores[0]
                else stores[0].v_caches[layer]
            )
    t = int(q_lens.sum())
    for layer in range(CONFIG.num_layers):
        q = rng.uniform(-1, 1, (t, 4, 16)).astype(np.float32)
        k = rng.uniform(-1, 1, (t, 2, 16)).astype(np.float32)
        v = rng.uniform(-1, 1, (t, 2, 16)).astype(np.float32)
        ref, got = (s.attend(layer, q, k, v) for s in stores)
        np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5)
        assert np.array_equal(stores[0].k_caches[layer], stores[1].k_caches[layer])
