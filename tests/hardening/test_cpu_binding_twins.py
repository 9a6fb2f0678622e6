"""The CPU bindings of plain and quantized caches read the arguments they share with one helper
each (``rust/pagedkv-python/src/cpu_ops/``), so they refuse them alike: the same typed error, the
same message, the same first refusal when several arguments are wrong, and nothing written.

Each case calls a plain binding and its quantized twin (``_core.cpu_*`` against
``_core.cpu_quant_*`` / ``cpu_*_block_bytes``) with one shared argument broken and compares
the two messages with each other and with the message the shared helper writes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from pagedkv import _core
from pagedkv.attention import QuantizedKvCache
from pagedkv.errors import InvalidArgumentError

BS, HEADS, DIM, Q_HEADS, BLOCKS = 4, 1, 8, 2, 4


def _plain_caches() -> tuple[np.ndarray, np.ndarray]:
    shape = (BLOCKS, BS, HEADS, DIM)
    return np.zeros(shape, np.float32), np.zeros(shape, np.float32)


def _quant_caches() -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    out = []
    for role in ("key", "value"):
        c = QuantizedKvCache.empty("int8", role, BLOCKS, BS, HEADS, DIM)
        out.append((c.data, None, "int8", role, BS, HEADS, DIM))
    return out[0], out[1]


def _refusal(call: Any) -> str:
    with pytest.raises(InvalidArgumentError) as info:
        call()
    return str(info.value)


def _attention_args(**broken: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "q": np.zeros((2, Q_HEADS, DIM), np.float32),
        "block_tables": np.array([[0], [1]], np.int32),
        "seq_lens": np.array([1, 1], np.int32),
    }
    args.update(broken)
    return args


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        ({"q": np.zeros((2, Q_HEADS, DIM))}, "q: dtype float64 is not supported by backend='cpu'"),
        ({"q": np.zeros((2, Q_HEADS), np.float32)}, "q must be 3-D, got shape [2, 2]"),
        ({"seq_lens": np.array([1, 1], np.int64)}, "seq_lens must be a int32 NumPy array"),
        ({"block_tables": (np.zeros(3, np.int32),)}, "a CSR page table is"),
        # Two arguments wrong: seq_lens is read before the tables in both.
        (
            {"seq_lens": np.zeros((2, 1), np.int32), "block_tables": np.zeros(2, np.int32)},
            "seq_lens must be 1-D",
        ),
        ({"q": np.zeros((2, Q_HEADS, 4), np.float32)}, "q head_dim 4 != cache head_dim 8"),
    ],
)
@pytest.mark.parametrize("prefill", [False, True])
def test_attention_twins_refuse_alike(broken: dict[str, Any], message: str, prefill: bool) -> None:
    args = _attention_args(**broken)
    k, v = _plain_caches()
    kq, vq = _quant_caches()
    if prefill:
        qsl = np.array([0, 1, 2], np.int32)
        plain = _refusal(
            lambda: _core.cpu_paged_prefill_attention(k_cache=k, v_cache=v, query_start_loc=qsl, **args)
        )
        quant = _refusal(
            lambda: _core.cpu_quant_paged_prefill_attention(
                k_cache=kq, v_cache=vq, query_start_loc=qsl, **args
            )
        )
    else:
        plain = _refusal(lambda: _core.cpu_paged_attention(k_cache=k, v_cache=v, **args))
        quant = _refusal(lambda: _core.cpu_quant_paged_attention(k_cache=kq, v_cache=vq, **args))
    assert plain == quant
    assert plain.startswith(message), plain


def test_write_kv_twins_refuse_new_tokens_alike() -> None:
    k, v = _plain_caches()
    kq, vq = _quant_caches()
    slots = np.array([0, 1], np.int64)
    cases = [
        # (k, v, slot_mapping): the new tokens' checks, in the order the helper reads them.
        (np.zeros((2, HEADS, DIM), np.float32), np.zeros((2, HEADS, 4), np.float32), slots),
        (
            np.zeros((2, HEADS, DIM), np.float32),
            np.zeros((2, HEADS, DIM), np.float32),
            slots.astype(np.int32),
        ),
        (np.zeros((2, HEADS), np.float32), np.zeros((2, HEADS, DIM), np.float32), slots.astype(np.int32)),
    ]
    want = [
        "k [2, 1, 8] and v [2, 1, 4] must be [num_tokens, 1, 8]",
        "slot_mapping must be a int64 NumPy array",
        "k must be 3-D, got shape [2, 1]",
    ]
    for (nk, nv, sm), message in zip(cases, want, strict=True):
        plain = _refusal(lambda nk=nk, nv=nv, sm=sm: _core.cpu_write_kv(nk, nv, k, v, sm))
        quant = _refusal(lambda nk=nk, nv=nv, sm=sm: _core.cpu_quant_write_kv(nk, nv, kq, vq, sm))
        assert plain == quant == message
    assert not k.any() and not kq[0].any()  # refused before any write


def test_one_cache_passed_twice_is_refused_alike() -> None:
    k, _ = _plain_caches()
    kq, _ = _quant_caches()
    new = np.ones((1, HEADS, DIM), np.float32)
    slots = np.array([0], np.int64)
    plain = _refusal(lambda: _core.cpu_write_kv(new, new, k, k, slots))
    quant = _refusal(lambda: _core.cpu_quant_write_kv(new, new, kq, kq, slots))
    assert plain.startswith("v_cache is read-only or borrowed twice"), plain
    assert quant.startswith("v_cache.data is read-only or borrowed twice"), quant
    assert not k.any() and not kq[0].any()


@pytest.mark.parametrize(
    "ops", [np.zeros((2, 3), np.int32), np.zeros(2, np.int32), np.zeros((2, 2), np.int64)]
)
def test_copy_twins_refuse_copy_ops_alike(ops: np.ndarray) -> None:
    k, v = _plain_caches()
    kq, vq = _quant_caches()
    plain = _refusal(lambda: _core.cpu_copy_blocks([k], [v], ops))
    quant = _refusal(lambda: _core.cpu_copy_block_bytes([kq[0], vq[0]], ops))
    assert plain == quant
    if ops.ndim == 2 and ops.dtype == np.int32:
        assert plain == "copy_ops must be [N, 2] (src, dst), got shape [2, 3]"


def test_swap_twins_refuse_alike() -> None:
    src, dst = _plain_caches()
    src[...] = 1
    bsrc, bdst = np.ones((BLOCKS, 16), np.uint8), np.zeros((BLOCKS, 16), np.uint8)
    mapping = np.array([[0, 1]], np.int32)

    def both(s: Any, d: Any, bs: Any, bd: Any, m: Any) -> tuple[str, str]:
        return (
            _refusal(lambda: _core.cpu_swap_blocks(s, d, m)),
            _refusal(lambda: _core.cpu_swap_block_bytes(bs, bd, m)),
        )

    plain, quant = both(src, dst, bsrc, bdst, np.zeros((1, 3), np.int32))
    assert plain == quant == "mapping must be [N, 2] (src_block, dst_block), got shape [1, 3]"
    dst.flags.writeable = False
    bdst.flags.writeable = False
    plain, quant = both(src, dst, bsrc, bdst, mapping)
    assert plain.startswith("dst_cache is read-only or borrowed twice"), plain
    assert quant.startswith("dst_cache is read-only or borrowed twice"), quant
    dst.flags.writeable = True
    bdst.flags.writeable = True
    plain, quant = both(
        src, np.zeros((BLOCKS, BS, HEADS, 4), np.float32), bsrc, np.zeros((BLOCKS, 8), np.uint8), mapping
    )
    assert plain.endswith("must have one block shape"), plain
    assert quant.endswith("must have one row length"), quant
    assert not dst.any() and not bdst.any()
    # Accepted, both copy the one block.
    assert _core.cpu_swap_blocks(src, dst, mapping) == _core.cpu_swap_block_bytes(bsrc, bdst, mapping) == 1
    assert dst[1].all() and not dst[0].any() and bdst[1].all() and not bdst[0].any()
