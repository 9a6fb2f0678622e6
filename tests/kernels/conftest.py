"""Shared builders for the kernel tests: random paged KV problems with poisoned padding."""

from __future__ import annotations

import shutil
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from pagedkv.attention.dtypes import float32_to_bf16_bits, nan_fill_value

KIND_DTYPES = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32, "float64": np.float64}
# Kernel output vs the NumPy reference (both accumulate in fp32; the output rounding may differ by an ulp).
TOLERANCE = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}

needs_cxx = pytest.mark.skipif(shutil.which("g++") is None, reason="backend='emulated' needs g++")


def cupy_and_gpu_marks(reason: str) -> tuple[Any, list[pytest.MarkDecorator]]:
    """CuPy and the marks of a GPU test module: the whole module skips without CuPy (``reason``) or
    without a CUDA device, so the ``gpu`` tests never fail on a CPU-only machine."""
    cupy = pytest.importorskip("cupy", reason=reason)
    try:
        devices = int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # CuPy without a driver raises its own runtime errors here
        devices = 0
    return cupy, [pytest.mark.gpu, pytest.mark.skipif(devices == 0, reason="no CUDA GPU")]


def stable_seed(*parts: object) -> int:
    """A seed from a test's parameters that is the same in every process (``hash()`` of a string
    is salted per process, so it would make a failure impossible to reproduce)."""
    return zlib.crc32(repr(parts).encode())


def to_kind(x: np.ndarray, kind: str) -> np.ndarray:
    """Float array -> array of the KV kind (bfloat16 as uint16 bit patterns)."""
    if kind == "bfloat16":
        return float32_to_bf16_bits(np.asarray(x, dtype=np.float32))
    return np.asarray(x).astype(KIND_DTYPES[kind])


def as_float(x: np.ndarray, kind: str) -> np.ndarray:
    from pagedkv.attention.dtypes import to_compute

    return to_compute(x, kind).astype(np.float64)


@dataclass
class PagedProblem:
    q: np.ndarray  # [num_seqs, num_q_heads, head_dim]
    k_cache: np.ndarray  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: np.ndarray
    block_tables: np.ndarray  # int32 [num_seqs, max_blocks]
    seq_lens: np.ndarray  # int32 [num_seqs]
    keys: list[np.ndarray]  # per sequence [seq_len, num_kv_heads, head_dim]
    values: list[np.ndarray]
    kind: str


def make_problem(
    rng: np.random.Generator,
    kind: str,
    seq_lens: list[int],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    spare_blocks: int = 3,
    extra_table_cols: int = 2,
) -> PagedProblem:
    """A batch whose blocks sit at random, non-contiguous ids. Every cache slot no sequence uses is
    NaN, and table padding points at whole-NaN spare blocks (or -1), so any stray read shows."""
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + spare_blocks
    ids = rng.permutation(num_blocks)
    spare = ids[sum(needed) :]
    fill = nan_fill_value(kind)
    k_cache = np.full((num_blocks, block_size, num_kv_heads, head_dim), fill, dtype=KIND_DTYPES[kind])
    v_cache = k_cache.copy()
    max_blocks = max(needed, default=0) + extra_table_cols
    tables = np.full((len(seq_lens), max_blocks), -1, dtype=np.int32)
    keys, values = [], []
    pos = 0
    for b, n in enumerate(seq_lens):
        row = ids[pos : pos + needed[b]]
        pos += needed[b]
        tables[b, : needed[b]] = row
        if len(spare) and b % 2 == 0:
            tables[b, needed[b] :] = rng.choice(spare, size=max_blocks - needed[b])
        k = to_kind(rng.standard_normal((n, num_kv_heads, head_dim)), kind)
        v = to_kind(rng.standard_normal((n, num_kv_heads, head_dim)), kind)
        for t in range(n):
            k_cache[row[t // block_size], t % block_size] = k[t]
            v_cache[row[t // block_size], t % block_size] = v[t]
        keys.append(k)
        values.append(v)
    q = to_kind(rng.standard_normal((len(seq_lens), num_kv_heads * group, head_dim)), kind)
    return PagedProblem(q, k_cache, v_cache, tables, np.array(seq_lens, dtype=np.int32), keys, values, kind)


def assert_close(actual: np.ndarray, expected: np.ndarray, kind: str) -> None:
    a, e = as_float(actual, kind), as_float(expected, kind)
    assert not np.isnan(a).any(), "kernel output holds NaN (stray read of a poisoned slot?)"
    tol = TOLERANCE[kind]
    np.testing.assert_allclose(a, e, rtol=tol, atol=tol)
