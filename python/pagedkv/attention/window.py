"""Sliding-window attention: the ``window=`` argument of ``paged_attention`` and
``paged_prefill_attention``.

The window is inclusive, as in Gemma (Hugging Face's ``sliding_window``) and Mistral: a query at
position ``p`` sees the keys at positions ``[p - window + 1, p]`` (``window`` keys, itself
included), clipped at 0. ``window=None`` is full causal attention.

Under a window, a block whose tokens all lie before the first key any query of the call can see
is never read, so its table entry may be ``-1`` (a block a sliding-window KV group has released);
the checks accept that and still require every block the call reads to be a block id.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedkv.errors import InvalidArgumentError

__all__ = ["WINDOW_BACKENDS", "check_window", "first_visible_key", "kernel_window"]

# The kernels' window argument is an int32; no kernel sequence is longer than this
# (validation.MAX_KERNEL_SEQ_LEN), so a larger window means the same as this one.
_KERNEL_WINDOW_CAP = 1 << 30
# Positions and lengths are int32, so a window of 2^31 keys already sees every key: a longer one is
# clipped to it (int64 position arithmetic in the checks stays in range; 2**70 is not an error).
_WINDOW_CLIP = 1 << 31

# Backends that implement window= (every one; the kernels take it as a runtime argument and skip the keys
# before each query's window).
WINDOW_BACKENDS = ("numpy", "cpu", "cuda", "emulated")


def check_window(window: Any, backend: str) -> int | None:
    """``window`` as an int >= 1 or None (a window above 2^31 keys clipped to 2^31, which means the
    same: all keys); InvalidArgumentError for anything else, or for a backend that does not
    implement sliding-window attention."""
    if window is None:
        return None
    if isinstance(window, (bool, np.bool_)) or not isinstance(window, (int, np.integer)):
        raise InvalidArgumentError(f"window must be a positive int or None, got {window!r}")
    if int(window) < 1:
        raise InvalidArgumentError(f"window must be >= 1 (keys a query sees, itself included), got {window}")
    if backend not in WINDOW_BACKENDS:
        raise InvalidArgumentError(
            f"window= (sliding-window attention) is not supported by backend={backend!r}"
        )
    return min(int(window), _WINDOW_CLIP)


def first_visible_key(positions: np.ndarray, window: int | None) -> np.ndarray:
    """The first key position each query position sees: ``max(0, p - window + 1)`` (0 without a
    window). int64, the shape of ``positions``."""
    positions = np.asarray(positions, dtype=np.int64)
    if window is None:
        return np.zeros_like(positions)
    return np.maximum(positions - (window - 1), 0)


def kernel_window(window: int | None) -> int:
    """The kernels' runtime ``window`` argument: 0 for no window, else the window capped at the
    longest kernel sequence (so it fits an int32 and means the same)."""
    return 0 if window is None else min(int(window), _KERNEL_WINDOW_CAP)
