"""The decode benchmark's correctness step (``gpu_decode.py``): small paged problems through a
backend against the NumPy reference (both decode kernels, forced and automatic splits), a
sliding-window step through DecodeWorkspace(window=), and the dense baseline."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
from gpu_decode_sweep import BLOCK_SIZE, GROUPS, HEAD_DIM, KINDS, WINDOW, has_cuda_core_baseline
from gpu_dense_decode import DenseDecode
from gpu_dense_decode import check as dense_check


def correctness(backend: str, xp: Any) -> list[str]:
    """Small paged problems through `backend` against the NumPy reference; returns failures."""
    from pagedkv.attention import paged_attention
    from pagedkv.attention.dtypes import float32_to_bf16_bits, to_compute

    failures = []
    rng = np.random.default_rng(1)
    for kind, group, splits in itertools.product(KINDS, GROUPS, (None, 1, 4)):
        heads, lens = 2, [1, 100, 333]
        blocks = sum(math.ceil(n / BLOCK_SIZE) for n in lens) + 2
        tables = np.full((len(lens), math.ceil(max(lens) / BLOCK_SIZE) + 1), -1, np.int32)
        ids = rng.permutation(blocks)
        pos = 0
        for b, n in enumerate(lens):
            k = math.ceil(n / BLOCK_SIZE)
            tables[b, :k] = ids[pos : pos + k]
            pos += k

        def make(shape: tuple[int, ...], kind: str = kind) -> np.ndarray:
            x = rng.standard_normal(shape).astype(np.float32)
            return float32_to_bf16_bits(x) if kind == "bfloat16" else x.astype(np.float16)

        q = make((len(lens), heads * group, HEAD_DIM))
        k_cache = make((blocks, BLOCK_SIZE, heads, HEAD_DIM))
        v_cache = make((blocks, BLOCK_SIZE, heads, HEAD_DIM))
        seq_lens = np.array(lens, np.int32)
        expected = to_compute(paged_attention(q, k_cache, v_cache, tables, seq_lens), kind)
        # Tables and lengths stay on the host: the no-sync path an engine uses.
        args = [xp.asarray(a) for a in (q, k_cache, v_cache)] + [tables, seq_lens]
        # Both decode kernels where the launcher picks tensor cores (the sweep times both).
        paths = (None, False) if has_cuda_core_baseline(kind, HEAD_DIM, group) else (None,)
        for use in paths:
            out = paged_attention(*args, backend=backend, num_splits=splits, use_tensor_cores=use)
            out = to_compute(out.get() if hasattr(out, "get") else out, kind)
            tol = 2e-3 if kind == "float16" else 1.6e-2
            err = float(np.max(np.abs(out - expected)))
            status = "ok" if err <= tol and not np.isnan(out).any() else "FAIL"
            path = "" if use is None else " cuda-core"
            print(
                f"  correctness {kind:<8} group={group} splits={splits}{path}: max|err|={err:.2e} "
                f"(tol {tol}) {status}"
            )
            if status != "ok":
                failures.append(f"{kind} group={group} splits={splits}{path}: {err}")
    return failures + windowed_workspace_correctness(backend, xp)


def windowed_workspace_correctness(
    backend: str, xp: Any, kinds: tuple[str, ...] = KINDS, window: int = WINDOW
) -> list[str]:
    """A sliding-window decode step through DecodeWorkspace(window=), the sweep's timed path, against
    the NumPy reference: the blocks wholly before each sequence's window released (NaN, table
    entry -1), as a sliding-window KV group leaves them. Returns failures. backend 'numpy' (the
    dry run) has no workspace: paged_attention(window=) runs the same problem instead."""
    from pagedkv.attention import DecodeWorkspace, paged_attention
    from pagedkv.attention.dtypes import float32_to_bf16_bits, nan_fill_value, to_compute

    failures = []
    rng = np.random.default_rng(2)
    lens, heads, group = [1, 100, 333, 700], 2, 4
    path = "paged_attention" if backend == "numpy" else "workspace"
    for kind in kinds:
        blocks = sum(math.ceil(n / BLOCK_SIZE) for n in lens) + 2
        tables = np.full((len(lens), math.ceil(max(lens) / BLOCK_SIZE)), -1, np.int32)
        ids, pos = rng.permutation(blocks), 0
        for b, n in enumerate(lens):
            tables[b, : math.ceil(n / BLOCK_SIZE)] = ids[pos : pos + math.ceil(n / BLOCK_SIZE)]
            pos += math.ceil(n / BLOCK_SIZE)
        x = rng.standard_normal((len(lens), heads * group, HEAD_DIM)).astype(np.float32)
        caches = rng.standard_normal((2, blocks, BLOCK_SIZE, heads, HEAD_DIM)).astype(np.float32)
        if kind == "bfloat16":
            q, k_cache, v_cache = (
                float32_to_bf16_bits(x),
                float32_to_bf16_bits(caches[0]),
                float32_to_bf16_bits(caches[1]),
            )
        else:
            q, k_cache, v_cache = (
                x.astype(np.float16),
                caches[0].astype(np.float16),
                caches[1].astype(np.float16),
            )
        seq_lens = np.array(lens, np.int32)
        expected = to_compute(paged_attention(q, k_cache, v_cache, tables, seq_lens, window=window), kind)
        for b, n in enumerate(lens):  # release what slid out of the window
            released = max(0, n - window) // BLOCK_SIZE
            k_cache[tables[b, :released]] = nan_fill_value(kind)
            v_cache[tables[b, :released]] = nan_fill_value(kind)
            tables[b, :released] = -1
        for splits in (None, 3):
            if backend == "numpy":
                out = paged_attention(q, k_cache, v_cache, tables, seq_lens, window=window, num_splits=splits)
            else:
                ws = DecodeWorkspace(
                    num_blocks=blocks,
                    block_size=BLOCK_SIZE,
                    num_kv_heads=heads,
                    num_q_heads=heads * group,
                    head_dim=HEAD_DIM,
                    dtype=q.dtype,
                    max_num_seqs=len(lens),
                    max_blocks_per_seq=tables.shape[1],
                    backend=backend,
                    split_bytes=1 << 20,
                    window=window,
                )
                ws.plan(tables, seq_lens, num_splits=splits)
                dq, dk, dv = (xp.asarray(a) for a in (q, k_cache, v_cache))
                out = ws.run(dq, dk, dv, out=xp.empty_like(dq))
            out = to_compute(out.get() if hasattr(out, "get") else out, kind)
            tol = 2e-3 if kind == "float16" else 1.6e-2
            err = float(np.max(np.abs(out - expected)))
            status = "ok" if err <= tol and not np.isnan(out).any() else "FAIL"
            print(
                f"  correctness {kind:<8} group={group} splits={splits} window={window} {path}: "
                f"max|err|={err:.2e} (tol {tol}) {status}"
            )
            if status != "ok":
                failures.append(f"{kind} window={window} splits={splits} {path}: {err}")
    return failures


def dense_correctness(dense: DenseDecode | None, xp: Any) -> list[str]:
    """The dense baseline against the NumPy reference on a small problem (dense None, xp numpy:
    its matmul form on the CPU); returns failures."""
    failures = []
    for kind in KINDS:
        backend, err, tol = dense_check(kind, dense, xp)
        status = "ok" if err <= tol else "FAIL"
        print(f"  correctness {kind:<8} dense baseline ({backend}): max|err|={err:.2e} (tol {tol}) {status}")
        if status != "ok":
            failures.append(f"{kind} dense baseline {backend}: {err}")
    return failures
