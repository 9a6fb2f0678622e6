"""Child side of ``test_fuzz_subprocess.py``: builds arrays from JSON specs, calls the manager
with each, and prints ``BAD<TAB>reason`` for any broken promise. Run in its own interpreter so
that an abort or a segfault is a test failure, not a pytest crash.

Contract checked per case (docs/security.md): the call either raises a ``PagedKvError`` (or
``MemoryError``) and changes nothing, or succeeds; and an array that holds the same integers as a
plain list (any integer dtype, byte order, strides, read-only, misaligned, non-masked subclass)
behaves exactly as that list: the same result or error class, the same state afterwards.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
import pagedkv

HUGE = 1 << 40


class Tagged(np.ndarray):
    """An ndarray subclass with no behaviour of its own (like ``memmap``)."""


def build(spec: dict[str, Any]) -> tuple[Any, list[int] | None]:
    """(the array to pass, the plain list it must behave like, or None when it must be refused)."""
    dtype = np.dtype(spec["dtype"])
    if dtype.itemsize > 1 and spec["order"] != "=":
        dtype = dtype.newbyteorder(spec["order"])
    values = np.array(spec["values"], dtype=np.int64).astype(dtype)  # wraps into the dtype
    plain = values.tolist() if dtype.kind in "iu" else None
    layout = spec["layout"]
    if layout == "contiguous":
        return values, plain
    if layout == "negative_stride":
        return np.ascontiguousarray(values[::-1])[::-1], plain
    if layout == "strided":
        wide = np.repeat(values, 2)
        return wide[::2], plain
    if layout == "readonly":
        values.flags.writeable = False
        return values, plain
    if layout == "misaligned":
        raw = np.zeros(values.nbytes + 1, dtype=np.uint8)[1:]
        arr = raw.view(dtype) if values.size else np.zeros(0, dtype=dtype)
        arr[...] = values
        return arr, plain
    if layout == "subclass":
        return values.view(Tagged), plain
    if layout == "broadcast":
        first = values[:1] if values.size else np.zeros(1, dtype=dtype)
        arr = np.broadcast_to(first, (len(spec["values"]),))
        return arr, (arr.tolist() if dtype.kind in "iu" else None)
    if layout == "broadcast_huge":
        return np.broadcast_to(np.zeros(1, dtype=dtype), (HUGE,)), None
    if layout == "masked":
        return np.ma.array(values, mask=[i % 2 == 0 for i in range(values.size)]), None
    if layout == "matrix":
        return np.asmatrix(values.reshape(1, -1)), None
    if layout == "two_d":
        return values.reshape(1, -1), None
    if layout == "zero_d":
        return np.array(values[0] if values.size else 0, dtype=dtype), None
    raise AssertionError(layout)


def fresh() -> pagedkv.KvCacheManager:
    kv = pagedkv.KvCacheManager(
        num_blocks=24, block_size=4, enable_prefix_caching=True, enable_kv_events=True, num_host_blocks=8
    )
    kv.add_sequence(0, [1, 2, 3, 4, 5])
    kv.add_sequence(1, [1, 2, 3, 4, 9, 9])
    kv.fork(1, 2)
    kv.add_sequence(3, num_tokens=2)
    return kv


def state(kv: pagedkv.KvCacheManager) -> Any:
    tables = []
    for seq in range(6):
        if seq in kv:
            swapped = kv.is_swapped_out(seq)
            tables.append(
                (seq, kv.num_tokens(seq), swapped, None if swapped else kv.block_table(seq).tolist())
            )
    return tables, kv.stats(), kv.take_copy_ops().tolist(), [repr(e) for e in kv.take_events()]


def _size(a: Any) -> int:
    return int(np.size(a)) if isinstance(a, np.ndarray) else len(a)


CALLS = {
    "add_sequence": lambda kv, a: kv.add_sequence(7, a),
    "append_tokens": lambda kv, a: kv.append_tokens(0, a),
    "batch_tokens": lambda kv, a: kv.append_tokens_batch([0, 3], a, num_tokens=max(1, _size(a) // 2)),
    "batch_ids": lambda kv, a: kv.append_tokens_batch(a),
    "free_batch": lambda kv, a: kv.free_batch(a),
    "batch_block_tables": lambda kv, a: kv.batch_block_tables(a),
    "slot_mapping": lambda kv, a: kv.slot_mapping(a, 1),
    "swap_out": lambda kv, a: kv.swap_out(a),
    "swap_in": lambda kv, a: kv.swap_in(a),
}


def outcome(kv: pagedkv.KvCacheManager, call: str, arg: Any) -> tuple[str, Any]:
    try:
        result = CALLS[call](kv, arg)
    except (pagedkv.PagedKvError, MemoryError) as exc:
        return "error", type(exc).__name__
    except Exception as exc:  # noqa: BLE001 - an untyped error is the finding
        return "untyped", f"{type(exc).__name__}: {exc}"
    if isinstance(result, tuple):
        result = tuple(np.asarray(r).tolist() for r in result)
    elif isinstance(result, np.ndarray):
        result = result.tolist()
    return "ok", result


def _caches() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    shape = (6, 2, 1, 4)  # [num_blocks, block_size, num_kv_heads, head_dim]
    return rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)


def _pairs(a: Any) -> Any:
    """The index array as [N, 2] pairs (1-D arrays of even length are reshaped, others kept)."""
    if isinstance(a, np.ndarray) and a.ndim == 1 and a.size % 2 == 0 and a.size < HUGE:
        return a.reshape(-1, 2)
    return a


def _data_call(call: str, a: Any) -> tuple[tuple[str, Any], list[Any]]:
    from pagedkv import attention

    k, v = _caches()
    try:
        if call == "copy_blocks":
            result = attention.copy_blocks([k], [v], _pairs(a))
        elif call == "swap_blocks":
            dst = np.zeros_like(k)
            result = attention.swap_blocks(k, dst, _pairs(a))
            v = dst
        elif call == "write_kv":
            n = int(np.size(a)) if isinstance(a, np.ndarray) and np.size(a) < HUGE else 1
            new = np.full((n, 1, 4), 7.0, dtype=np.float32)
            result = attention.write_kv(new, new, k, v, a)
        else:  # paged_attention with `a` as seq_lens of one-row tables
            n = int(np.size(a)) if isinstance(a, np.ndarray) and np.size(a) < HUGE else 1
            q = np.ones((n, 1, 4), dtype=np.float32)
            tables = np.tile(np.arange(6, dtype=np.int32), (n, 1))
            result = attention.paged_attention(q, k, v, tables, a)
    except (pagedkv.PagedKvError, MemoryError) as exc:
        return ("error", type(exc).__name__), [k.tolist(), v.tolist()]
    except Exception as exc:  # noqa: BLE001 - an untyped error is the finding
        return ("untyped", f"{type(exc).__name__}: {exc}"), []
    out = result.tolist() if isinstance(result, np.ndarray) else result
    return ("ok", out), [k.tolist(), v.tolist()]


DATA_CALLS = {"copy_blocks", "swap_blocks", "write_kv", "paged_attention"}


def check_data_plane(spec: dict[str, Any]) -> str | None:
    """Either a typed error that wrote nothing, or the result of the same values as a plain,
    contiguous, native-order array of the same dtype."""
    arg, _ = build(spec)
    got, caches = _data_call(spec["call"], arg)
    if got[0] == "untyped":
        return f"untyped error {got[1]}"
    if got[0] == "error":
        _, untouched = _data_call("copy_blocks", np.zeros((0, 2), dtype=np.int32))
        return None if caches == untouched else "a refused data-plane call wrote a cache"
    if isinstance(arg, np.ma.MaskedArray):
        return "a masked array was accepted"
    plain = np.ascontiguousarray(np.asarray(arg)).astype(np.asarray(arg).dtype.newbyteorder("="))
    expected, expected_caches = _data_call(spec["call"], plain)
    if (got, caches) != (expected, expected_caches):
        return f"array gave {got}, its plain copy {expected}"
    return None


def check(spec: dict[str, Any]) -> str | None:
    if spec["call"] in DATA_CALLS:
        return check_data_plane(spec)
    arg, plain = build(spec)
    kv = fresh()
    before = state(kv)
    kv = fresh()
    got = outcome(kv, spec["call"], arg)
    after = state(kv)
    kv.check_invariants()
    if got[0] == "untyped":
        return f"untyped error {got[1]}"
    if plain is None:
        if got[0] != "error":
            return f"refused input accepted: {got}"
        if after != before:
            return "a refused call changed state"
        return None
    ref = fresh()
    expected = outcome(ref, spec["call"], plain)
    if got != expected:
        return f"array gave {got}, the same list gave {expected}"
    if after != state(ref):
        return "array and list left different states"
    if got[0] == "error" and after != before:
        return "a failed call changed state"
    return None


def main() -> None:
    specs = json.load(sys.stdin)
    for i, spec in enumerate(specs):
        print(f"START\t{i}", flush=True)
        problem = check(spec)
        if problem:
            print(f"BAD\t{json.dumps(spec)}\t{problem}", flush=True)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
