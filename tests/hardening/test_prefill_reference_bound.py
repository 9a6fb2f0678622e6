"""Hardening: the NumPy references (prefill and decode) sized a temporary from the block table.

A 4 MiB table repeating block 0 against a 128 KiB cache made ``gather_rows`` ask for a copy of
16M tokens (gigabytes) and loop over a million blocks. The reference now refuses a sequence
longer than the caches hold, before anything is allocated; up to that bound it still runs. With a
sliding window only the keys the window can see count, so a long sequence whose released blocks are
-1 still runs.
"""

from __future__ import annotations

import numpy as np
import pagedkv
import pytest
from hardening_isolated import run_cases
from pagedkv.attention import paged_attention, paged_prefill_attention

NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 16, 16, 2, 32  # float32: 64 KiB per cache

SETUP = f"""
import os, resource
os.environ["OPENBLAS_NUM_THREADS"] = "1"
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # the old copy needed more than this
import numpy as np
import pagedkv
from pagedkv.attention import paged_attention, paged_prefill_attention
k = np.ones(({NUM_BLOCKS}, {BLOCK_SIZE}, {NUM_KV_HEADS}, {HEAD_DIM}), np.float32)
v = np.ones_like(k)
q = np.ones((1, {NUM_KV_HEADS}, {HEAD_DIM}), np.float32)
table = np.zeros((1, 1 << 20), np.int32)  # 4 MiB, every entry block 0
seq_lens = np.array([(1 << 20) * {BLOCK_SIZE}], np.int32)
qsl = np.array([0, 1], np.int32)
"""


def test_a_table_repeating_one_block_is_refused_before_any_allocation() -> None:
    outcomes = run_cases(
        SETUP,
        {
            "padded": 'paged_prefill_attention(q, k, v, table, seq_lens, qsl, backend="numpy")',
            "csr": "paged_prefill_attention(q, k, v, (np.array([0, 1 << 20], np.int32), table[0], "
            f'np.array([{BLOCK_SIZE}], np.int32)), seq_lens, qsl, backend="numpy")',
            "decode": 'paged_attention(q, k, v, table, seq_lens, backend="numpy")',
        },
        timeout_s=120,
    )
    assert outcomes == {
        "padded": "InvalidArgumentError",
        "csr": "InvalidArgumentError",
        "decode": "InvalidArgumentError",
    }


def caches(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)


def test_up_to_the_cache_a_repeating_table_still_runs() -> None:
    rng = np.random.default_rng(0)
    k, v = caches(rng)
    capacity = NUM_BLOCKS * BLOCK_SIZE
    q = rng.standard_normal((2, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)
    table = np.zeros((1, NUM_BLOCKS + 1), np.int32)
    qsl = np.array([0, 2], np.int32)
    out = paged_prefill_attention(q, k, v, table, np.array([capacity], np.int32), qsl, backend="numpy")
    # Every key is block 0's: the result is attention over block 0 repeated, finite.
    assert out.shape == q.shape and np.isfinite(out).all()
    with pytest.raises(pagedkv.InvalidArgumentError, match="more than the caches hold"):
        paged_prefill_attention(q, k, v, table, np.array([capacity + 1], np.int32), qsl, backend="numpy")
    with pytest.raises(pagedkv.InvalidArgumentError, match="more than the caches hold"):
        paged_attention(q[:1], k, v, table, np.array([capacity + 1], np.int32), backend="numpy")


def test_a_window_counts_only_the_keys_it_can_see() -> None:
    """A sequence far longer than the cache, its out-of-window blocks released (-1): both
    references run, and equal attention over the window's keys."""
    rng = np.random.default_rng(1)
    k, v = caches(rng)
    window, seq_len = 3 * BLOCK_SIZE, 40 * BLOCK_SIZE  # the pool holds 16 blocks
    table = np.full((1, 40), -1, np.int32)
    table[0, -4:] = [3, 7, 1, 12]  # the blocks covering the last window keys
    q = rng.standard_normal((1, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)
    out = paged_attention(q, k, v, table, np.array([seq_len], np.int32), backend="numpy", window=window)
    keys = np.concatenate([k[b] for b in (3, 7, 1, 12)])[-window:]
    vals = np.concatenate([v[b] for b in (3, 7, 1, 12)])[-window:]
    ref = pagedkv.attention.contiguous_attention(q[0], keys, vals, backend="numpy")
    np.testing.assert_array_equal(out[0], ref)
    qsl = np.array([0, 1], np.int32)
    out_p = paged_prefill_attention(
        q, k, v, table, np.array([seq_len], np.int32), qsl, backend="numpy", window=window
    )
    np.testing.assert_array_equal(out_p[0], ref)
