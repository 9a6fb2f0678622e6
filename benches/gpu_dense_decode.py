"""The decode baseline of ``gpu_decode.py``: dense attention over a contiguous cache, same run.

Each sweep point's problem without paging: K and V as contiguous ``[batch, num_kv_heads,
context, head_dim]`` tensors (the bytes the paged kernel reads, in one piece), one query token per
sequence, every key visible, timed like the paged kernel (CUDA events, L2 flushed before every
launch). ``dense time / paged time`` (> 1: the paged kernel is faster) is what the page table and
our kernel cost or gain against what a framework runs on an unpaged cache.

Backends, the first that works:
- ``sdpa``: PyTorch's ``scaled_dot_product_attention(q [B, Hq, 1, D], k, v [B, Hkv, L, D],
  enable_gqa=True)`` with its own kernel choice (what a PyTorch user gets);
- ``torch-matmul``: the same in three steps (scaled q K^T on tensor cores, fp32 softmax, P V),
  where SDPA refuses the call (a torch without ``enable_gqa``);
- ``cupy-matmul``: the three steps in CuPy where torch is absent or sees no GPU. CuPy has no
  bfloat16, so bf16 points run in fp16 there (the same bytes).
The matmul forms read K and V once per KV head (the group's query heads share one product) and
also write and read the fp32 scores ``[B, Hkv, group, L]``: an unfused baseline.

``check(kind, xp)`` runs the chosen backend on a small problem against the NumPy reference, so a
baseline that computes something else is caught before it is timed; with ``xp = numpy`` (a dry
run) it checks the matmul form on the CPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def matmul_decode(xp: Any, q: Any, k: Any, v: Any, scale: float) -> Any:
    """Dense decode attention in three array operations. q: [B, Hkv, group, D]; k, v: [B, Hkv, L,
    D], one 16-bit dtype (NumPy or CuPy). Returns [B, Hkv, group, D] in that dtype. q is scaled
    before the product so the 16-bit scores keep their precision."""
    scores = xp.matmul(q * q.dtype.type(scale), xp.swapaxes(k, -1, -2)).astype(xp.float32)
    scores -= scores.max(axis=-1, keepdims=True)
    p = xp.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    return xp.matmul(p.astype(v.dtype), v)


def torch_matmul_decode(torch: Any, q: Any, k: Any, v: Any, scale: float) -> Any:
    """matmul_decode in PyTorch (bf16 included)."""
    scores = torch.matmul(q * scale, k.transpose(-1, -2)).float()
    return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)


class DenseDecode:
    """Builds the dense baseline of a sweep point on the device; ``backend`` says which ran."""

    def __init__(self, cupy: Any) -> None:
        self.cupy = cupy
        self.torch: Any = None
        try:
            import torch

            if torch.cuda.is_available():
                self.torch = torch
        except Exception:  # not installed, or a broken install
            self.torch = None
        self.backend = "sdpa" if self.torch is not None else "cupy-matmul"
        self.version = "" if self.torch is None else f"PyTorch {self.torch.__version__}"

    def _tensors(self, kind: str, shapes: list[tuple[int, ...]], seed: int) -> list[Any]:
        if self.torch is not None:
            torch = self.torch
            dtype = torch.float16 if kind == "float16" else torch.bfloat16
            gen = torch.Generator(device="cuda").manual_seed(seed)
            return [torch.randn(s, device="cuda", dtype=dtype, generator=gen) for s in shapes]
        cupy = self.cupy
        rng = cupy.random.default_rng(seed)
        return [rng.standard_normal(s, dtype=cupy.float32).astype(cupy.float16) for s in shapes]

    def _runner(self, q: Any, k: Any, v: Any, group: int, scale: float) -> tuple[Any, str]:
        """A no-argument callable running the baseline once on these tensors, and its backend.
        q: [B, Hq, D]; k, v: [B, Hkv, L, D]."""
        batch, num_q_heads, head_dim = (int(s) for s in q.shape)
        num_kv_heads = num_q_heads // group
        if self.torch is None:
            qg = q.reshape(batch, num_kv_heads, group, head_dim)
            return (lambda: matmul_decode(self.cupy, qg, k, v, scale)), "cupy-matmul"
        torch = self.torch
        sdpa = torch.nn.functional.scaled_dot_product_attention
        q4 = q.reshape(batch, num_q_heads, 1, head_dim)

        def run_sdpa() -> Any:
            return sdpa(q4, k, v, scale=scale, enable_gqa=group > 1)

        try:
            run_sdpa()  # raises where this torch cannot run the call
            return run_sdpa, "sdpa"
        except (RuntimeError, TypeError):
            qg = q.reshape(batch, num_kv_heads, group, head_dim)
            return (lambda: torch_matmul_decode(torch, qg, k, v, scale)), "torch-matmul"

    def prepare(
        self, kind: str, batch: int, num_kv_heads: int, group: int, context: int, head_dim: int
    ) -> tuple[Any, str]:
        """Random tensors of the point's shapes on the device and the timed callable over them."""
        q, k, v = self._tensors(
            kind,
            [
                (batch, num_kv_heads * group, head_dim),
                (batch, num_kv_heads, context, head_dim),
                (batch, num_kv_heads, context, head_dim),
            ],
            seed=context + batch,
        )
        return self._runner(q, k, v, group, 1.0 / head_dim**0.5)

    def release(self) -> None:
        """Gives memory the baseline's framework cached back to the device (CuPy's pool is freed
        by the caller)."""
        if self.torch is not None:
            self.torch.cuda.empty_cache()

    def check(self, kind: str, xp: Any = None) -> tuple[str, float, float]:
        """(backend, max |error|, tolerance) of the baseline on a small problem against the NumPy
        reference (the paged kernel's tolerance). xp = numpy: the matmul form on the CPU."""
        return check(kind, self, xp)


def check(kind: str, dense: DenseDecode | None, xp: Any = None) -> tuple[str, float, float]:
    """See DenseDecode.check; ``dense`` None with ``xp = numpy`` checks matmul_decode on the CPU."""
    from pagedkv.attention import contiguous_attention
    from pagedkv.attention.dtypes import float32_to_bf16_bits, to_compute

    rng = np.random.default_rng(3)
    batch, num_kv_heads, group, context, head_dim = 2, 2, 4, 100, 128
    x = rng.standard_normal((batch, num_kv_heads * group, head_dim)).astype(np.float32)
    kv = rng.standard_normal((2, batch, num_kv_heads, context, head_dim)).astype(np.float32)
    cpu_matmul = dense is None or xp is np
    # The reference in the precision the baseline runs: CuPy has no bf16, so fp16 there.
    run_kind = "float16" if kind == "bfloat16" and (cpu_matmul or dense.torch is None) else kind

    def as_kind(a: np.ndarray) -> np.ndarray:
        return float32_to_bf16_bits(a) if run_kind == "bfloat16" else a.astype(np.float16)

    q, k, v = as_kind(x), as_kind(kv[0]), as_kind(kv[1])
    scale = 1.0 / head_dim**0.5
    expected = np.stack(
        [
            to_compute(contiguous_attention(q[b], k[b].transpose(1, 0, 2), v[b].transpose(1, 0, 2)), run_kind)
            for b in range(batch)
        ]
    )
    if cpu_matmul:
        qg = q.reshape(batch, num_kv_heads, group, head_dim)
        out = to_compute(matmul_decode(np, qg, k, v, scale).reshape(batch, -1, head_dim), run_kind)
        backend = "numpy-matmul"
    else:
        assert dense is not None
        if dense.torch is not None:
            torch = dense.torch
            dtype = torch.float16 if run_kind == "float16" else torch.bfloat16
            q_d, k_d, v_d = (
                torch.from_numpy(a.view(np.int16)).cuda().view(dtype)
                if run_kind == "bfloat16"
                else torch.from_numpy(a).cuda()
                for a in (q, k, v)
            )
        else:
            q_d, k_d, v_d = (dense.cupy.asarray(a) for a in (q, k, v))
        run, backend = dense._runner(q_d, k_d, v_d, group, scale)
        result = run().reshape(batch, num_kv_heads * group, head_dim)
        if dense.torch is not None:
            bits = result.contiguous().view(dense.torch.int16) if run_kind == "bfloat16" else result
            host = bits.cpu().numpy()
            host = host.view(np.uint16) if run_kind == "bfloat16" else host
        else:
            host = result.get()
        out = to_compute(host, run_kind)
    tol = 2e-3 if run_kind == "float16" else 1.6e-2
    err = float(np.max(np.abs(out - expected)))
    return backend, err, tol
