"""bf16 projection weights and their product with fp32 activations (the Rust kernel).

At decode batch sizes a forward pass streams every projection weight once per step, so the
weights' bytes bound it: SmolLM2-135M reads 540 MB per step in fp32, 270 MB in bf16. The
weights come from a 4-bit file (Q4_1), so bf16's 8-bit mantissa adds an error far below the
quantization the file already has (docs/cpu_data_plane.md gives the measured logit difference
against llama.cpp). Activations stay fp32 and the products accumulate in fp32.

``Bf16Weights(w)`` holds an ``[in, out]`` matrix as bf16 bits in the kernel's panels (blocks of
64 output columns, each ``[in, 64]`` contiguous, so that a task streams its weights in order);
``weights.matmul(x)`` computes ``x [t, in] @ w`` on both cores with the GIL released. Every output
is the in-order sum over ``in``, so a token's result does not depend on the batch it is in.
"""

from __future__ import annotations

import numpy as np

from pagedkv import _core
from pagedkv.errors import InvalidArgumentError

__all__ = ["PANEL_COLUMNS", "Bf16Weights", "bf16_bits_to_f32", "to_bf16_bits"]

PANEL_COLUMNS = 64  # output columns per panel (the kernel's task)


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


class Bf16Weights:
    """An ``[in, out]`` fp32 matrix rounded to bf16 and laid out as the kernel's panels."""

    def __init__(self, w_in_out: np.ndarray) -> None:
        w = np.asarray(w_in_out, dtype=np.float32)
        if w.ndim != 2:
            raise InvalidArgumentError(f"weights must be 2-D [in, out], got shape {w.shape}")
        k, n = w.shape
        panels = -(-n // PANEL_COLUMNS)
        padded = np.zeros((k, panels * PANEL_COLUMNS), np.uint16)
        padded[:, :n] = to_bf16_bits(w)
        self.in_features, self.out_features = int(k), int(n)
        self.panels = np.ascontiguousarray(padded.reshape(k, panels, PANEL_COLUMNS).transpose(1, 0, 2))

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """``x [t, in]`` (float32) @ the weights: fp32 ``[t, out]``. A wrong dtype, rank or width
        raises ``InvalidArgumentError``."""
        if isinstance(x, np.ndarray) and not x.flags.c_contiguous:
            x = np.ascontiguousarray(x)
        return _core.cpu_matmul_bf16(x, self.panels, self.out_features)

    def to_f32(self) -> np.ndarray:
        """The bf16 weights widened back to fp32 ``[in, out]`` (exact)."""
        k = self.in_features
        cols = self.panels.transpose(1, 0, 2).reshape(k, self.panels.shape[0] * PANEL_COLUMNS)[
            :, : self.out_features
        ]
        return bf16_bits_to_f32(cols)
