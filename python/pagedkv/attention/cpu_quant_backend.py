"""``backend="cpu"`` on quantized caches (``QuantizedKvCache``): the Rust CPU data plane's
``pagedkv_cpu::quant`` through ``pagedkv._core``.

Like ``cpu_backend``, this layer only prepares arrays: each cache goes to Rust as the tuple
``(data, residual, kv_cache_dtype, role, block_size, num_kv_heads, head_dim)`` (used in place,
never copied; ``residual`` the bytes of an int4 cache's int8 residual slots), queries, new keys
and values and integer metadata as contiguous arrays. Every check that guards memory (the block
layout against the byte rows, block ids, slots, the int4 residual slots and the seal plan) runs in
Rust before the first write and raises ``InvalidArgumentError``; the kernels run with the GIL
released.

Writes produce the NumPy reference's bytes bit for bit, and attention reads exactly its
dequantized values (docs/quantized_kv.md); attention itself sums in the CPU kernels' order, so it
agrees with the reference within the CPU data plane's tolerance (docs/cpu_data_plane.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedkv.attention.cpu_backend import _input, _out, attention_inputs, check_causal
from pagedkv.attention.quantized_cache import QuantizedKvCache
from pagedkv.attention.window import check_window
from pagedkv.errors import InvalidArgumentError

__all__ = [
    "copy_blocks",
    "paged_attention",
    "paged_prefill_attention",
    "swap_blocks",
    "write_kv",
]

_GEOMETRY = ("kv_cache_dtype", "block_size", "num_kv_heads", "head_dim")


def _cache(name: str, cache: Any) -> tuple[Any, ...]:
    """The tuple the bindings take for one quantized cache."""
    if not isinstance(cache, QuantizedKvCache):
        raise InvalidArgumentError(
            f"{name} must be a QuantizedKvCache like the other cache, got {type(cache).__name__}"
        )
    residual = None if cache.residual is None else cache.residual.data
    for part, x in (("data", cache.data), ("residual.data", residual)):
        if x is not None and not isinstance(x, np.ndarray):
            raise InvalidArgumentError(
                f"{name}.{part}: backend='cpu' takes NumPy arrays, got {type(x).__name__}"
            )
    return (
        cache.data,
        residual,
        cache.kv_cache_dtype,
        cache.role,
        cache.block_size,
        cache.num_kv_heads,
        cache.head_dim,
    )


def _slots(residual_slots: Any) -> np.ndarray | None:
    return None if residual_slots is None else _input("residual_slots", residual_slots)


def paged_attention(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    block_tables: Any,
    seq_lens: Any,
    *,
    scale: float | None = None,
    window: int | None = None,
    residual_slots: Any = None,
) -> np.ndarray:
    """Paged decode attention on quantized caches (``pagedkv.attention.paged_attention``)."""
    from pagedkv import _core

    a = attention_inputs(q, block_tables, seq_lens, scale, csr=False)
    out = _core.cpu_quant_paged_attention(
        a.q,
        _cache("k_cache", k_cache),
        _cache("v_cache", v_cache),
        a.tables,
        a.seq_lens,
        _slots(residual_slots),
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
    residual_slots: Any = None,
) -> np.ndarray:
    """Paged prefill attention on quantized caches (``pagedkv.attention.paged_prefill_attention``);
    ``block_tables`` padded or the CSR triple."""
    from pagedkv import _core

    a = attention_inputs(q, block_tables, seq_lens, scale, csr=True)
    qsl = _input("query_start_loc", query_start_loc)
    is_causal = check_causal(causal)
    out = _core.cpu_quant_paged_prefill_attention(
        a.q,
        _cache("k_cache", k_cache),
        _cache("v_cache", v_cache),
        a.tables,
        a.seq_lens,
        qsl,
        _slots(residual_slots),
        a.scale,
        is_causal,
        check_window(window, "cpu"),
    )
    return _out(out, q)


def write_kv(
    k: Any, v: Any, k_cache: Any, v_cache: Any, slot_mapping: Any, residual_slots: Any = None
) -> None:
    """``pagedkv.attention.write_kv`` on quantized caches: quantize on write; int4 seals the blocks
    the write fills and parks the rest in the residual slots (docs/quantized_kv.md, "Writes")."""
    from pagedkv import _core

    _core.cpu_quant_write_kv(
        _input("k", k),
        _input("v", v),
        _cache("k_cache", k_cache),
        _cache("v_cache", v_cache),
        _input("slot_mapping", slot_mapping),
        _slots(residual_slots),
    )


def _same_geometry(name: str, a: QuantizedKvCache, b: QuantizedKvCache, fields: tuple[str, ...]) -> None:
    for field in fields:
        if getattr(a, field) != getattr(b, field):
            raise InvalidArgumentError(
                f"{name} differ in {field}: {getattr(a, field)!r} vs {getattr(b, field)!r}"
            )


def copy_blocks(k_caches: Any, v_caches: Any, copy_ops: Any) -> None:
    """``pagedkv.attention.copy_blocks``: each (src, dst) block's bytes, in order, every layer
    (residual slots are per sequence and not touched)."""
    from pagedkv import _core

    if not isinstance(k_caches, (list, tuple)) or not isinstance(v_caches, (list, tuple)):
        raise InvalidArgumentError("k_caches and v_caches must be lists (one cache per layer)")
    if len(k_caches) == 0 or len(k_caches) != len(v_caches):
        raise InvalidArgumentError(
            f"k_caches ({len(k_caches)}) and v_caches ({len(v_caches)}) must list the same layers, "
            "at least one"
        )
    for i, (k, v) in enumerate(zip(k_caches, v_caches, strict=True)):
        _cache(f"k_caches[{i}]", k)
        _cache(f"v_caches[{i}]", v)
        if k.role != "key" or v.role != "value":
            raise InvalidArgumentError(f"layer {i}: k_caches hold role 'key', v_caches role 'value'")
        _same_geometry(f"layer {i}'s caches and layer 0's", k, k_caches[0], _GEOMETRY)
        _same_geometry(f"layer {i}'s key and value caches", k, v, _GEOMETRY)
    ops = _input("copy_ops", copy_ops)
    # One call for keys and values (their rows differ in length for int4): a cache refused there
    # is refused before any block is copied.
    _core.cpu_copy_block_bytes([k.data for k in k_caches] + [v.data for v in v_caches], ops)


def swap_blocks(src_cache: Any, dst_cache: Any, mapping: Any) -> int:
    """``pagedkv.attention.swap_blocks`` between two quantized caches of one dtype, role and
    geometry: block bytes as they are; returns the number of copies."""
    from pagedkv import _core

    _cache("src_cache", src_cache)
    _cache("dst_cache", dst_cache)
    _same_geometry("src_cache and dst_cache", src_cache, dst_cache, (*_GEOMETRY, "role"))
    return int(_core.cpu_swap_block_bytes(src_cache.data, dst_cache.data, _input("mapping", mapping)))
