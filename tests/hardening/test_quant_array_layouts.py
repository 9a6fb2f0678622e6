"""Every array the quantized-cache CPU calls read, in every layout (``array_layouts.LAYOUTS``):
``_core.cpu_quant_paged_attention``, ``cpu_quant_paged_prefill_attention`` (padded and CSR
tables), ``cpu_quant_write_kv``, ``cpu_copy_block_bytes``, ``cpu_swap_block_bytes``, directly and
through ``pagedkv.attention`` with ``backend="cpu"``, for int8, fp8_e4m3 and int4 caches.

Each array is read as its values or refused with ``InvalidArgumentError``, never misread: a
result equals, bit for bit, the same call on plain arrays, which equals the NumPy reference (writes,
copies and swaps bit for bit; attention within the CPU data plane's fp32 tolerance,
docs/quantized_kv.md). Through ``pagedkv.attention`` only a cache's own arrays (block bytes and
int4 residual slots' bytes, used in place) may be refused; called directly, every array that cannot be read in
place is. A cache that is written must also be writable in place, and a refused call writes
nothing. docs/security.md lists the guarantee.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from array_layouts import LAYOUTS, in_place, layout, same_or_refused, writable_in_place
from pagedkv import _core
from pagedkv.attention import (
    QuantizedKvCache,
    copy_blocks,
    paged_attention,
    paged_prefill_attention,
    swap_blocks,
    write_kv,
)

DTYPES = ("int8", "fp8_e4m3", "int4")
BS, HEADS, DIM, Q_HEADS = 4, 1, 8, 2
SEQ_LENS = (6, 3)  # int4: sequence 0 has one sealed block and two residual tokens, sequence 1 three
TABLES = ((2, 0), (3, -1))  # block 1 is free (poisoned): a misread table shows as NaN
CACHE_PARTS = ("k_cache.data", "k_cache.residual", "v_cache.data", "v_cache.residual", "host.data")
Arrays = dict[str, np.ndarray]


def _filled_caches(dtype: str) -> Arrays:
    """A key and a value cache holding SEQ_LENS tokens at TABLES (written by the NumPy reference),
    unused block and residual bytes 0xFF (NaN when read)."""
    rng = np.random.default_rng(31)
    caches = [
        QuantizedKvCache.empty(
            dtype,
            role,
            4,
            BS,
            HEADS,
            DIM,
            num_residual_slots=2 if dtype == "int4" else 0,
        )
        for role in ("key", "value")
    ]
    for c in caches:
        c.data[...] = 0xFF
        if c.residual is not None:
            c.residual.data[...] = 0xFF
    seq = [np.repeat(b, n) for b, n in enumerate(SEQ_LENS)]
    pos = np.concatenate([np.arange(n) for n in SEQ_LENS])
    seqs = np.concatenate(seq)
    blocks = np.array([TABLES[b][p // BS] for b, p in zip(seqs, pos, strict=True)], np.int64)
    k, v = (rng.standard_normal((len(pos), HEADS, DIM)).astype(np.float32) for _ in range(2))
    res = seqs.astype(np.int32) if dtype == "int4" else None
    write_kv(k, v, caches[0], caches[1], blocks * BS + pos % BS, residual_slots=res)
    out = {"k_cache.data": caches[0].data, "v_cache.data": caches[1].data}
    if dtype == "int4":
        out |= {"k_cache.residual": caches[0].residual.data, "v_cache.residual": caches[1].residual.data}
    return out


@dataclass
class Call:
    """One call: its arrays (fresh each time), the names to lay out, and the names it writes."""

    arrays: Arrays
    vary: tuple[str, ...]
    written: tuple[str, ...]


def _call(name: str, dtype: str) -> Call:
    rng = np.random.default_rng(32)
    a = _filled_caches(dtype)
    int4 = dtype == "int4"
    slots = {"residual_slots": np.array([0, 1], np.int32)} if int4 else {}
    parts = tuple(n for n in CACHE_PARTS if n in a)
    if name in ("decode", "prefill", "prefill_csr"):
        rows = 2 if name == "decode" else 5
        a["q"] = rng.standard_normal((rows, Q_HEADS, DIM)).astype(np.float32)
        a["seq_lens"] = np.array(SEQ_LENS, np.int32)
        if name == "prefill_csr":
            a["kv_indptr"] = np.array([0, 2, 3], np.int32)
            a["kv_indices"] = np.array([2, 0, 3], np.int32)
            a["kv_last_page_len"] = np.array([2, 3], np.int32)
        else:
            a["block_tables"] = np.array(TABLES, np.int32)
        if name != "decode":
            a["query_start_loc"] = np.array([0, 3, 5], np.int32)
        a |= slots
        return Call(a, tuple(a), ())
    if name == "write":
        # Sequence 0's token 6 (block 0, still open) and sequence 1's token 3 (fills block 3).
        a["k"], a["v"] = (rng.standard_normal((2, HEADS, DIM)).astype(np.float32) for _ in range(2))
        a["slot_mapping"] = np.array([0 * BS + 2, 3 * BS + 3], np.int64)
        a |= slots
        return Call(a, tuple(a), parts)
    if name == "copy":
        a["copy_ops"] = np.array([[2, 1], [3, 0]], np.int32)
        return Call(a, ("k_cache.data", "v_cache.data", "copy_ops"), ("k_cache.data", "v_cache.data"))
    assert name == "swap"
    host = np.zeros((3, a["k_cache.data"].shape[1]), np.uint8)
    a |= {"host.data": host, "mapping": np.array([[2, 0], [3, 1], [0, 2]], np.int32)}
    if int4:
        a["host.residual"] = np.zeros((0, a["k_cache.residual"].shape[1]), np.uint8)
    return Call(a, ("k_cache.data", "host.data", "mapping"), ("host.data",))


CALLS = ("decode", "prefill", "prefill_csr", "write", "copy", "swap")


def _quantized(a: Arrays, dtype: str, prefix: str, role: str) -> QuantizedKvCache:
    residual = None
    if f"{prefix}.residual" in a:  # int4: its int8 residual slots
        residual = QuantizedKvCache(a[f"{prefix}.residual"], "int8", role, BS, HEADS, DIM)
    return QuantizedKvCache(a[f"{prefix}.data"], dtype, role, BS, HEADS, DIM, residual=residual)


def _tuple(a: Arrays, dtype: str, prefix: str, role: str) -> tuple[Any, ...]:
    return (a[f"{prefix}.data"], a.get(f"{prefix}.residual"), dtype, role, BS, HEADS, DIM)


def _tables(a: Arrays) -> Any:
    if "block_tables" in a:
        return a["block_tables"]
    return (a["kv_indptr"], a["kv_indices"], a["kv_last_page_len"])


def _run(name: str, dtype: str, a: Arrays, layer: str) -> Any:
    """The call on ``a`` through ``layer``: "numpy" (the reference), "cpu" (``pagedkv.attention``
    with backend="cpu") or "core" (``_core`` directly). Returns the output, or the return value
    and the written arrays' bits."""
    if layer == "core":
        k, v = _tuple(a, dtype, "k_cache", "key"), _tuple(a, dtype, "v_cache", "value")
        calls: dict[str, Callable[[], Any]] = {
            "decode": lambda: _core.cpu_quant_paged_attention(
                a["q"], k, v, _tables(a), a["seq_lens"], a.get("residual_slots")
            ),
            "prefill": lambda: _core.cpu_quant_paged_prefill_attention(
                a["q"], k, v, _tables(a), a["seq_lens"], a["query_start_loc"], a.get("residual_slots")
            ),
            "write": lambda: _core.cpu_quant_write_kv(
                a["k"], a["v"], k, v, a["slot_mapping"], a.get("residual_slots")
            ),
            "copy": lambda: _core.cpu_copy_block_bytes([a["k_cache.data"], a["v_cache.data"]], a["copy_ops"]),
            "swap": lambda: _core.cpu_swap_block_bytes(a["k_cache.data"], a["host.data"], a["mapping"]),
        }
    else:
        kw = {"backend": layer}
        k, v = _quantized(a, dtype, "k_cache", "key"), _quantized(a, dtype, "v_cache", "value")
        slots = {"residual_slots": a["residual_slots"]} if "residual_slots" in a else {}
        calls = {
            "decode": lambda: paged_attention(a["q"], k, v, _tables(a), a["seq_lens"], **slots, **kw),
            "prefill": lambda: paged_prefill_attention(
                a["q"], k, v, _tables(a), a["seq_lens"], a["query_start_loc"], **slots, **kw
            ),
            "write": lambda: write_kv(a["k"], a["v"], k, v, a["slot_mapping"], **slots, **kw),
            "copy": lambda: copy_blocks([k], [v], a["copy_ops"], **kw),
            "swap": lambda: swap_blocks(k, _quantized(a, dtype, "host", "key"), a["mapping"], **kw),
        }
    out = calls[name.removesuffix("_csr")]()
    if name in ("decode", "prefill", "prefill_csr"):
        return _bits(out)
    written = [n for n in CACHE_PARTS if n in a]
    return out if name != "swap" else int(out), [_bits(a[n]) for n in written]


def _bits(x: Any) -> np.ndarray:
    """``x``'s values as native-order bytes (NaN == NaN), whatever its layout."""
    x = np.asarray(x)
    return np.ascontiguousarray(x.astype(x.dtype.newbyteorder("="))).view(np.uint8)


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, np.ndarray):
        return bool(np.array_equal(got, want))
    return bool(got[0] == want[0]) and all(np.array_equal(g, w) for g, w in zip(got[1], want[1], strict=True))


@pytest.mark.parametrize("layer", ["cpu", "core"])
@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quant_calls_read_every_array_in_every_layout(dtype: str, call: str, layer: str) -> None:
    want = _run(call, dtype, _call(call, dtype).arrays, layer)
    ref = _run(call, dtype, _call(call, dtype).arrays, "numpy")
    if isinstance(want, np.ndarray):  # attention: the reference within the fp32 tolerance
        got, exp = want.view(np.float32), ref.view(np.float32)
        assert not np.isnan(exp).any()
        np.testing.assert_allclose(got, exp, rtol=0, atol=2e-5 * max(1.0, float(np.abs(exp).max())))
    else:  # writes, copies, swaps: the reference's bytes
        assert _same(want, ref)
    seen = set()
    for name in _call(call, dtype).vary:
        for kind in LAYOUTS:
            c = _call(call, dtype)
            c.arrays[name] = x = layout(c.arrays[name], kind)
            before = [_bits(c.arrays[n]) for n in c.written]
            outcome = same_or_refused(lambda c=c: _run(call, dtype, c.arrays, layer), want, _same)
            readable = writable_in_place(x) if name in c.written else in_place(x)
            # Through pagedkv.attention inputs are copied where need be; caches never are.
            expected = "same" if readable or (layer == "cpu" and name not in CACHE_PARTS) else "refused"
            assert outcome == expected, (name, kind)
            if outcome == "refused":  # before anything was written
                assert all(
                    np.array_equal(_bits(c.arrays[n]), b) for n, b in zip(c.written, before, strict=True)
                )
            seen.add(outcome)
    assert seen == {"same", "refused"}
