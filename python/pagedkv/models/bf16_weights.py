"""bf16 projection weights and their product with fp32 activations (the Rust kernel).

At decode batch sizes a forward pass streams every projection weight once per step, so the
weights' bytes bound it: SmolLM2-135M reads 540 MB per step in fp32, 270 MB in bf16. The
weights come from a 4-bit file (Q4_1), so bf16's 8-bit mantissa adds an error far below the
quantization the file already has (docs/cpu_data_plane.md gives the measured logit difference
against llama.cpp). Activations stay fp32 and the products accumulate in fp32.

``matmul_bf16(x, w)`` computes ``x [t, k] @ w [n, k]ᵀ`` with ``w`` the bf16 bit patterns of a
row-major ``[out, in]`` matrix (the GGUF layout), on both cores with the GIL released; every
output is one fixed-order sum, so a token's result does not depend on the batch it is in.
"""

from __future__ import annotations

import numpy as np

from pagedkv import _core

__all__ = ["bf16_bits_to_f32", "matmul_bf16", "to_bf16_bits"]


def to_bf16_bits(w: np.ndarray) -> np.ndarray:
    """fp32 values rounded to the nearest bf16 (ties to even), as C-contiguous uint16 bits.
    NaN stays NaN (quiet); values past bf16's largest finite round to infinity, as IEEE does."""
    bits = np.ascontiguousarray(w, dtype=np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(
        np.uint16
    )
    nan = np.isnan(bits.view(np.float32))
    if nan.any():
        rounded[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return rounded


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """uint16 bf16 bit patterns widened to fp32 (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def matmul_bf16(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x [t, k]`` (float32) times the transpose of ``w [n, k]`` (uint16 bf16 bits): fp32
    ``[t, n]``. A wrong dtype, rank or width raises ``InvalidArgumentError``."""
    if isinstance(x, np.ndarray) and not x.flags.c_contiguous:
        x = np.ascontiguousarray(x)
    return _core.cpu_matmul_bf16(x, w)
