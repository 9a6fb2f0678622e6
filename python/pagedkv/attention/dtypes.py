"""KV element types: which array dtypes mean what, and bfloat16 conversions.

NumPy and CuPy have no native bfloat16, so a bfloat16 tensor is passed as a ``uint16`` array
holding the bit patterns (or with ``ml_dtypes.bfloat16``, which NumPy sees as a 2-byte void-ish
dtype named "bfloat16"). Conversions round to nearest even, like the kernels.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedkv.errors import InvalidArgumentError

KERNEL_KINDS = ("float16", "bfloat16", "float32")
REFERENCE_KINDS = (*KERNEL_KINDS, "float64")


def kind_of(dtype: Any) -> str:
    """The KV element kind of an array dtype: float16, bfloat16, float32 or float64."""
    dt = np.dtype(dtype)
    if dt == np.float16:
        return "float16"
    if dt == np.float32:
        return "float32"
    if dt == np.float64:
        return "float64"
    if dt == np.uint16 or dt.name == "bfloat16":
        return "bfloat16"
    raise InvalidArgumentError(
        f"unsupported KV dtype {dt}: use float16, float32, float64 (numpy backend only) or "
        "bfloat16 (as uint16 bit patterns)"
    )


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """uint16 (or bfloat16) array of bfloat16 bit patterns -> float32 array (exact)."""
    u = np.ascontiguousarray(bits).view(np.uint16).astype(np.uint32) << np.uint32(16)
    return u.view(np.float32)


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 array -> uint16 bfloat16 bit patterns, round to nearest even; NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    is_nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    quiet_nan = (u >> np.uint32(16)) | np.uint32(0x0040)
    return np.where(is_nan, quiet_nan, rounded).astype(np.uint16)


def compute_dtype(kind: str) -> np.dtype:
    """The accumulation dtype of a KV kind: float64 for float64, float32 otherwise."""
    return np.dtype(np.float64 if kind == "float64" else np.float32)


def to_compute(x: np.ndarray, kind: str) -> np.ndarray:
    """Widen to the accumulation type: float32 for 16-bit kinds and float32, float64 for float64."""
    if kind == "bfloat16":
        return bf16_bits_to_float32(x)
    if kind == "float64":
        return np.asarray(x, dtype=np.float64)
    return np.asarray(x, dtype=np.float32)


def from_compute(x: np.ndarray, kind: str, like: np.dtype) -> np.ndarray:
    """Narrow an accumulation-type result back to the KV dtype ``like``."""
    if kind == "bfloat16":
        return float32_to_bf16_bits(x).view(like)
    return np.asarray(x).astype(like)


def nan_fill_value(kind: str) -> Any:
    """A value that fills an array of this kind with NaN (bfloat16: the quiet NaN pattern)."""
    return 0x7FC0 if kind == "bfloat16" else np.nan
