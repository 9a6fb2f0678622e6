"""The array layouts the hardening tests feed the bindings, and how they judge the outcome
(``test_array_layouts.py``, ``test_quant_array_layouts.py``): misaligned (a C-contiguous array
over a buffer at an odd offset), strided, strides that are not whole items, the other byte order,
read-only. An array is read as its values or refused with ``InvalidArgumentError``, never misread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from pagedkv.errors import InvalidArgumentError

LAYOUTS = ("plain", "misaligned", "strided", "odd_strides", "byteswapped", "readonly")


def layout(a: np.ndarray, kind: str) -> np.ndarray:
    """``a``'s values in the layout ``kind`` (a fresh array; ``a`` is not changed)."""
    a = np.ascontiguousarray(a)
    if kind == "plain":
        return a.copy()
    if kind == "misaligned":  # C-contiguous, data at an odd address
        buf = np.zeros(a.nbytes + 1, np.uint8)
        out = buf[1:].view(a.dtype).reshape(a.shape)
        out[...] = a
        assert a.dtype.itemsize == 1 or not out.flags.aligned
        return out
    if kind == "strided":  # every other row of a twice-as-long array
        return np.repeat(a, 2, axis=0)[::2]
    if kind == "odd_strides":  # the first axis' stride is one byte more than a row
        row = a.strides[0] if a.ndim else a.itemsize
        shape, strides = a.shape, (row + 1, *a.strides[1:])
        buf = np.zeros(max(1, shape[0]) * (row + 1) + a.nbytes, np.uint8)
        out = np.ndarray(shape, a.dtype, buffer=buf, strides=strides)
        out[...] = a
        return out
    if kind == "byteswapped":
        return a.astype(a.dtype.newbyteorder("S"))
    if kind == "readonly":
        out = a.copy()
        out.flags.writeable = False
        return out
    raise AssertionError(kind)


def same_or_refused(run: Callable[[], Any], want: Any, compare: Callable[[Any, Any], bool]) -> str:
    """``run()`` gives ``want`` (by ``compare``) or raises InvalidArgumentError; which one."""
    try:
        got = run()
    except InvalidArgumentError:
        return "refused"
    assert compare(got, want), f"read wrong: {got!r} != {want!r}"
    return "same"


def in_place(x: np.ndarray) -> bool:
    """Whether the Rust side can use ``x`` in place (else it must refuse it, never misread it)."""
    return bool(x.flags.c_contiguous and x.flags.aligned and x.dtype.isnative)


def close(a: Any, b: Any) -> bool:
    return bool(np.allclose(a, b, atol=2e-5, rtol=1e-5))


def writable_in_place(x: np.ndarray) -> bool:
    """Whether the Rust side can write ``x`` in place (a cache it writes; else it must refuse it)."""
    return in_place(x) and bool(x.flags.writeable)
