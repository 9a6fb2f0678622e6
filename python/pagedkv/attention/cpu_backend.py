"""``backend="cpu"``: the Rust CPU data plane (crate ``pagedkv-cpu`` through ``pagedkv._core``).

This layer only prepares arrays: plain ``ndarray`` views, C-contiguous, aligned, native-byte-order
copies of the inputs that are not written in place (queries, new keys and values, integer
metadata) when they are not so already, bfloat16 arrays (``ml_dtypes``) viewed as their uint16
bits. Caches are never copied: a non-contiguous, misaligned or byte-swapped cache is refused
(``InvalidArgumentError``), as the Rust side refuses any array it cannot read in place. Every
check that guards memory (shapes, dtypes, block ids, slots, copy and swap ids) runs in Rust before
the first write and raises ``InvalidArgumentError``; the kernels run with the GIL released.
Results match the NumPy reference within the tolerance docs/cpu_data_plane.md states (fp32
accumulation in a different order; not bit-identical).

The extension is imported by each function, not by this module: ``pagedkv.attention`` (which the
GPU kernels' tests and benchmarks import) must load where the extension does not (pagedkv/__init__.py).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from pagedkv.attention import validation as val
from pagedkv.attention.window import check_window
from pagedkv.errors import InvalidArgumentError


def _array(name: str, x: Any) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        raise InvalidArgumentError(f"{name}: backend='cpu' takes NumPy arrays, got {type(x).__name__}")
    return val.unwrap_ndarray_subclass(name, x)


def _bits(x: np.ndarray) -> np.ndarray:
    """ml_dtypes bfloat16 arrays as their uint16 bit patterns (a view); others unchanged."""
    # dtype.kind first: dtype.name builds a string per call (benches/results/2026-12-06-comment-numbers.md),
    # and ml_dtypes' bfloat16 is the only 2-byte "V".
    return x.view(np.uint16) if x.dtype.kind == "V" and x.dtype.name == "bfloat16" else x


def _input(name: str, x: Any) -> np.ndarray:
    """An array read but never written, as the Rust side reads arrays in place: C-contiguous,
    aligned to its dtype and in native byte order (a copy when it is not; ``ascontiguousarray``
    alone keeps a misaligned or byte-swapped array as it is)."""
    return input_array(_bits(_array(name, x)))


def input_array(x: np.ndarray) -> np.ndarray:
    """``x`` C-contiguous, aligned and in native byte order: itself when it is, else a copy."""
    if not x.dtype.isnative:
        x = x.astype(x.dtype.newbyteorder("="))
    return np.require(x, requirements=("C", "A"))


def _cache(name: str, x: Any) -> np.ndarray:
    """A cache, used in place: never copied (the Rust side refuses a non-contiguous one)."""
    return _bits(_array(name, x))


def _scale(scale: Any, head_dim: int) -> float | None:
    return None if scale is None else val._scale(scale, head_dim)


def _out(out: np.ndarray, like: np.ndarray) -> np.ndarray:
    return out.view(like.dtype) if like.dtype.kind == "V" and like.dtype.name == "bfloat16" else out


class AttentionInputs(NamedTuple):
    """The arguments decode and prefill share, as the bindings take them (plain and quantized
    caches alike)."""

    q: np.ndarray
    tables: Any  # block_tables, or (prefill only) the CSR triple (kv_indptr, kv_indices, kv_last_page_len)
    seq_lens: np.ndarray
    scale: float | None


def attention_inputs(q: Any, block_tables: Any, seq_lens: Any, scale: Any, *, csr: bool) -> AttentionInputs:
    """Converts the shared attention arguments; ``csr``: ``block_tables`` may be the CSR triple
    (prefill)."""
    q_in = _input("q", q)
    if csr and isinstance(block_tables, tuple):
        tables: Any = tuple(
            _input(n, t)
            for n, t in zip(("kv_indptr", "kv_indices", "kv_last_page_len"), block_tables, strict=False)
        )
    else:
        tables = _input("block_tables", block_tables)
    head_dim = int(q_in.shape[-1]) if q_in.ndim else 1
    return AttentionInputs(q_in, tables, _input("seq_lens", seq_lens), _scale(scale, head_dim))


def check_causal(causal: Any) -> bool:
    if not isinstance(causal, (bool, np.bool_)):
        raise InvalidArgumentError(f"causal must be a bool, got {type(causal).__name__}")
    return bool(causal)


def paged_attention(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    block_tables: Any,
    seq_lens: Any,
    *,
    scale: float | None = None,
    window: int | None = None,
) -> np.ndarray:
    """Paged decode attention (``pagedkv.attention.paged_attention``); ``window``: the query sees
    only its sequence's last ``window`` keys, and table entries wholly before them are not read."""
    from pagedkv import _core

    a = attention_inputs(q, block_tables, seq_lens, scale, csr=False)
    out = _core.cpu_paged_attention(
        a.q,
        _cache("k_cache", k_cache),
        _cache("v_cache", v_cache),
        a.tables,
        a.seq_lens,
        a.scale,
        check_window(window, "cpu"),
    )
    return _out(out, q)


def paged_prefill_attention(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    block_tables: Any,
    seq_lens: Any,
    query_start_loc: Any,
    *,
    scale: float | None = None,
    causal: bool = True,
    window: int | None = None,
) -> np.ndarray:
    """Paged prefill attention (``pagedkv.attention.paged_prefill_attention``); ``block_tables``
    padded or the CSR triple; ``window`` as in ``paged_attention`` (needs ``causal``)."""
    from pagedkv import _core

    a = attention_inputs(q, block_tables, seq_lens, scale, csr=True)
    qsl = _input("query_start_loc", query_start_loc)
    is_causal = check_causal(causal)
    out = _core.cpu_paged_prefill_attention(
        a.q,
        _cache("k_cache", k_cache),
        _cache("v_cache", v_cache),
        a.tables,
        a.seq_lens,
        qsl,
        a.scale,
        is_causal,
        check_window(window, "cpu"),
    )
    return _out(out, q)


def write_kv(k: Any, v: Any, k_cache: Any, v_cache: Any, slot_mapping: Any) -> None:
    """``pagedkv.attention.write_kv``: -1 skips a token; every slot checked before any write."""
    from pagedkv import _core

    _core.cpu_write_kv(
        _input("k", k),
        _input("v", v),
        _cache("k_cache", k_cache),
        _cache("v_cache", v_cache),
        _input("slot_mapping", slot_mapping),
    )


def copy_blocks(k_caches: Any, v_caches: Any, copy_ops: Any) -> None:
    """``pagedkv.attention.copy_blocks``: copies in order, every layer, ids checked first."""
    from pagedkv import _core

    if not isinstance(k_caches, (list, tuple)) or not isinstance(v_caches, (list, tuple)):
        raise InvalidArgumentError("k_caches and v_caches must be lists (one cache per layer)")
    _core.cpu_copy_blocks(
        [_cache(f"k_caches[{i}]", c) for i, c in enumerate(k_caches)],
        [_cache(f"v_caches[{i}]", c) for i, c in enumerate(v_caches)],
        _input("copy_ops", copy_ops),
    )


def swap_blocks(src_cache: Any, dst_cache: Any, mapping: Any) -> int:
    """``pagedkv.attention.swap_blocks``: returns the number of copies (runs of adjacent blocks)."""
    from pagedkv import _core

    return int(
        _core.cpu_swap_blocks(
            _cache("src_cache", src_cache), _cache("dst_cache", dst_cache), _input("mapping", mapping)
        )
    )
