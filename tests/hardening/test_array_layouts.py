"""Every array the bindings read, in every layout NumPy allows: misaligned (a C-contiguous array
over a buffer at an odd offset), strided, strides that are not whole items, the other byte order,
read-only. Each is read as the same values (the result equals the NumPy backend's, or the same
call with a list), or refused with ``InvalidArgumentError``; never read as empty or from the
wrong offsets (``swap_blocks(..., backend="cpu")`` with a misaligned mapping
returned 0 and moved nothing). docs/security.md lists the guarantee.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pagedkv
import pytest
from pagedkv import _core
from pagedkv.attention import (
    contiguous_attention,
    copy_blocks,
    paged_attention,
    paged_prefill_attention,
    swap_blocks,
    write_kv,
)
from pagedkv.errors import InvalidArgumentError
from pagedkv.sim.engine import SimConfig, Workload, simulate

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


# ---------------------------------------------------------------------------------------------
# The CPU data plane through pagedkv.attention: inputs in any layout read as their values.


def _attention_args(rng: np.random.Generator) -> dict[str, np.ndarray]:
    k_cache = rng.standard_normal((6, 4, 2, 8)).astype(np.float32)
    return {
        "q": rng.standard_normal((2, 4, 8)).astype(np.float32),
        "k_cache": k_cache,
        "v_cache": rng.standard_normal(k_cache.shape).astype(np.float32),
        "block_tables": np.array([[3, 1, 0], [5, 2, 4]], np.int32),
        "seq_lens": np.array([9, 6], np.int32),
    }


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("name", ["q", "k_cache", "v_cache", "block_tables", "seq_lens"])
def test_paged_attention_reads_every_layout(name: str, kind: str) -> None:
    args = _attention_args(np.random.default_rng(1))
    want = paged_attention(**args)
    args[name] = layout(args[name], kind)
    cache = name.endswith("cache")
    outcome = same_or_refused(lambda: paged_attention(**args, backend="cpu"), want, close)
    # Inputs are always read (copied if need be); a cache is used in place, so one that cannot
    # be read in place is refused (a read-only one is fine: attention only reads it).
    assert outcome == ("refused" if cache and kind not in ("plain", "readonly") else "same")


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("name", ["q", "block_tables", "seq_lens", "query_start_loc", "csr"])
def test_paged_prefill_reads_every_layout(name: str, kind: str) -> None:
    args = _attention_args(np.random.default_rng(2))
    args["q"] = np.random.default_rng(3).standard_normal((5, 4, 8)).astype(np.float32)
    args["query_start_loc"] = np.array([0, 3, 5], np.int32)
    # The same tables as CSR (kv_indptr, kv_indices, kv_last_page_len), block size 4.
    csr = (np.array([0, 3, 5], np.int32), np.array([3, 1, 0, 5, 2], np.int32), np.array([1, 2], np.int32))
    want = paged_prefill_attention(**args)
    if name == "csr":
        args["block_tables"] = tuple(layout(x, kind) for x in csr)
    else:
        args[name] = layout(args[name], kind)
    assert same_or_refused(lambda: paged_prefill_attention(**args, backend="cpu"), want, close) == "same"


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("name", ["k", "v", "slot_mapping", "k_cache"])
def test_write_kv_reads_every_layout(name: str, kind: str) -> None:
    rng = np.random.default_rng(4)
    args = {
        "k": rng.standard_normal((3, 2, 8)).astype(np.float32),
        "v": rng.standard_normal((3, 2, 8)).astype(np.float32),
        "k_cache": np.zeros((4, 2, 2, 8), np.float32),
        "v_cache": np.zeros((4, 2, 2, 8), np.float32),
        "slot_mapping": np.array([5, -1, 2], np.int64),
    }
    want = {n: args[n].copy() for n in ("k_cache", "v_cache")}
    write_kv(**{**args, **want})
    args[name] = layout(args[name], kind)

    def run() -> tuple[np.ndarray, np.ndarray]:
        write_kv(**args, backend="cpu")
        return np.asarray(args["k_cache"]), args["v_cache"]

    outcome = same_or_refused(
        run,
        (want["k_cache"], want["v_cache"]),
        lambda g, w: all(np.array_equal(a, b) for a, b in zip(g, w, strict=True)),
    )
    assert outcome == ("refused" if name == "k_cache" and kind != "plain" else "same")


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("name", ["copy_ops", "k_caches[0]"])
def test_copy_blocks_reads_every_layout(name: str, kind: str) -> None:
    rng = np.random.default_rng(5)
    k, v = (rng.standard_normal((5, 2, 1, 4)).astype(np.float32) for _ in range(2))
    ops = np.array([[0, 3], [1, 4], [3, 2]], np.int32)
    want = [k.copy(), v.copy()]
    copy_blocks([want[0]], [want[1]], ops)
    if name == "copy_ops":
        ops = layout(ops, kind)
    else:
        k = layout(k, kind)

    def run() -> list[np.ndarray]:
        copy_blocks([k], [v], ops, backend="cpu")
        return [np.asarray(k), v]

    outcome = same_or_refused(
        run, want, lambda g, w: all(np.array_equal(a, b) for a, b in zip(g, w, strict=True))
    )
    assert outcome == ("refused" if name != "copy_ops" and kind != "plain" else "same")


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("name", ["mapping", "src_cache", "dst_cache"])
def test_swap_blocks_reads_every_layout(name: str, kind: str) -> None:
    """A misaligned (src, dst) array once made the CPU backend move nothing."""
    rng = np.random.default_rng(6)
    args = {
        "src_cache": rng.standard_normal((4, 2, 1, 4)).astype(np.float32),
        "dst_cache": np.zeros((3, 2, 1, 4), np.float32),
        "mapping": np.array([[0, 1], [1, 2], [3, 0]], np.int32),
    }
    want_dst = args["dst_cache"].copy()
    want_n = swap_blocks(args["src_cache"], want_dst, args["mapping"])
    args[name] = layout(args[name], kind)

    def run() -> tuple[int, np.ndarray]:
        n = swap_blocks(**args, backend="cpu")
        return n, np.asarray(args["dst_cache"])

    outcome = same_or_refused(
        run, (want_n, want_dst), lambda g, w: g[0] == w[0] and np.array_equal(g[1], w[1])
    )
    refused = (name == "dst_cache" and kind != "plain") or (
        name == "src_cache" and kind not in ("plain", "readonly")
    )
    assert outcome == ("refused" if refused else "same")


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_contiguous_attention_reads_every_layout(name: str, kind: str) -> None:
    rng = np.random.default_rng(7)
    args = {
        "q": rng.standard_normal((4, 8)).astype(np.float32),
        "k": rng.standard_normal((5, 2, 8)).astype(np.float32),
        "v": rng.standard_normal((5, 2, 8)).astype(np.float32),
    }
    want = contiguous_attention(**args)
    args[name] = layout(args[name], kind)
    assert same_or_refused(lambda: contiguous_attention(**args, backend="cpu"), want, close) == "same"


# ---------------------------------------------------------------------------------------------
# `_core.cpu_*` directly: an array it cannot read in place is refused, never misread.


def _elementwise_calls(rng: np.random.Generator) -> list[tuple[str, list[np.ndarray], Callable[..., Any]]]:
    x = rng.standard_normal((3, 8)).astype(np.float32)
    w = rng.standard_normal(8).astype(np.float32)
    qk = rng.standard_normal((3, 2, 8)).astype(np.float32)
    cs = rng.standard_normal((3, 4)).astype(np.float32)
    # bfloat16 bit patterns of normal floats (the top halves of float32s)
    panels = (rng.standard_normal((1, 8, 64)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return [
        ("rms_norm", [x, w], lambda a, b: _core.cpu_rms_norm(a, b, 1e-6)),
        ("add_rms_norm", [x, x[::-1].copy(), w], lambda a, b, c: _core.cpu_add_rms_norm(a, b, c, 1e-6)),
        ("silu_mul", [x], _core.cpu_silu_mul),
        ("rope", [qk, cs, cs[::-1].copy()], lambda a, b, c: _core.cpu_rope_interleaved(a, b, c)),
        ("matmul_bf16", [x, panels], lambda a, b: _core.cpu_matmul_bf16(a, b, 5)),
    ]


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("call", range(5))
def test_core_kernels_refuse_what_they_cannot_read_in_place(call: int, kind: str) -> None:
    name, arrays, fn = _elementwise_calls(np.random.default_rng(8))[call]
    want = fn(*arrays)
    for i in range(len(arrays)):
        args = list(arrays)
        args[i] = layout(arrays[i], kind)

        def compare(g: Any, w: Any) -> bool:
            pairs = zip(g, w, strict=True) if isinstance(w, tuple) else [(g, w)]
            return all(np.array_equal(a, b) for a, b in pairs)

        outcome = same_or_refused(lambda args=args: fn(*args), want, compare)
        assert outcome == ("same" if in_place(args[i]) else "refused"), (name, i, kind)


@pytest.mark.parametrize("kind", LAYOUTS)
def test_core_swap_refuses_a_mapping_it_cannot_read_in_place(kind: str) -> None:
    src = np.arange(16, dtype=np.float32).reshape(4, 2, 1, 2)
    mapping = layout(np.array([[1, 0], [2, 1]], np.int32), kind)
    dst = np.zeros((2, 2, 1, 2), np.float32)
    try:
        n = _core.cpu_swap_blocks(src, dst, mapping)
    except InvalidArgumentError:
        assert kind not in ("plain", "readonly")
        assert not dst.any()  # refused before any write
        return
    assert kind in ("plain", "readonly")
    assert n == 1 and np.array_equal(dst, src[1:3])


# ---------------------------------------------------------------------------------------------
# The manager: token and sequence ids in any layout read as the same ids as a list.

_INT_DTYPES = (np.uint32, np.int32, np.int64, np.uint64, np.int16, np.uint16)


def _script(kv: pagedkv.KvCacheManager, ids: Callable[[list[int]], Any]) -> list[Any]:
    """One pass over every manager call that takes an id array; `ids` makes each list."""
    out: list[Any] = []
    prompt = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]
    out.append(kv.add_sequence(1, ids(prompt)))
    out.append(kv.add_sequence(2, ids(list(range(50, 62))), num_scheduled=3))
    out.append(kv.advance_computed(ids([2]), 5))
    out.append(kv.add_sequence(3, ids([40, 41, 42, 43, 44, 45])))
    out.append(kv.append_tokens(1, ids([20, 21])))
    out.append(kv.append_tokens_batch(ids([1, 3]), ids([30, 31, 32, 33]), num_tokens=2))
    out.append(kv.match_prefix(ids(prompt + [20, 21, 30, 31, 5])))
    out.append(kv.pin_prefix(ids(prompt[:8])))
    out.append(kv.prefix_block_hashes(ids(prompt)))
    tables, lens = kv.batch_block_tables(ids([3, 1]))
    out += [tables.tolist(), lens.tolist()]
    out += [x.tolist() for x in kv.csr_page_table(ids([1, 3]))]
    out.append(kv.slot_mapping(ids([1, 3]), 2).tolist())
    out.append(kv.swap_out(ids([3])).tolist())
    out.append(kv.swap_in(ids([3])).tolist())
    out.append(kv.unpin_prefix(ids(prompt[:8])))
    out.append(kv.free_batch(ids([1, 3])))
    out.append(kv.match_prefix(ids(prompt)))
    out.append(_core.token_block_digests(ids(prompt), 4).tolist())
    kv.check_invariants()
    return out


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("dtype", _INT_DTYPES)
def test_manager_reads_id_arrays_in_every_layout(dtype: type, kind: str) -> None:
    def manager() -> pagedkv.KvCacheManager:
        return pagedkv.KvCacheManager(
            num_blocks=32, block_size=4, enable_prefix_caching=True, num_host_blocks=8
        )

    want = _script(manager(), list)
    got = _script(manager(), lambda v: layout(np.asarray(v, dtype=dtype), kind))
    assert got == want


@pytest.mark.parametrize("kind", LAYOUTS)
def test_simulator_reads_columns_in_every_layout(kind: str) -> None:
    def workload(col: Callable[[np.ndarray], np.ndarray]) -> Workload:
        return Workload(
            name="layouts",
            prompt_tokens=col(np.array([30, 50, 20, 70], np.int64)),
            output_tokens=col(np.array([10, 5, 40, 8], np.int64)),
            arrival_s=col(np.array([0.0, 0.5, 0.5, 2.0], np.float64)),
            group_size=col(np.array([1, 2, 1, 1], np.int64)),
            group_kind="parallel",
        )

    config = SimConfig(block_size=8, num_slots=512, max_model_len=256, arrival="trace")
    want = simulate(workload(lambda a: a), config).to_dict()
    got = simulate(workload(lambda a: layout(a, kind)), config).to_dict()
    assert got == want
