"""Fuzzing the kernel launchers (``backend="numpy"`` and ``"emulated"``).

Each case starts from a valid call and applies random malformations (dtypes, shapes,
contiguity, read-only outputs, out-of-range block ids / slots / lengths, bad scalars). Every call
must either succeed or raise ``InvalidArgumentError`` before anything runs: a rejected call writes
nothing. Every array sits inside a larger buffer whose margins hold a sentinel byte pattern, so
a write past any array (vector or scalar, which the harness's own check does not see) shows.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pagedkv
import pytest
from hypothesis import HealthCheck, example, given, settings
from pagedkv.attention import contiguous_attention, copy_blocks, paged_attention, swap_blocks, write_kv

BACKENDS = [
    "numpy",
    pytest.param("emulated", marks=pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")),
]
GUARD_BYTES = 64
SENTINEL = 0x7B
NUM_BLOCKS = 6
BLOCK_SIZE = 8
NUM_KV_HEADS = 1
HEAD_DIM = 64
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Guarded:
    """Arrays carved out of buffers with sentinel margins on both sides."""

    def __init__(self) -> None:
        self.buffers: list[tuple[np.ndarray, int, int]] = []  # (buffer bytes, start, stop)

    def array(self, values: np.ndarray) -> np.ndarray:
        nbytes = values.nbytes
        raw = np.empty(nbytes + 3 * GUARD_BYTES, dtype=np.uint8)
        start = (-raw.ctypes.data) % 16 + GUARD_BYTES  # 16-byte aligned, as kernels require
        raw[:] = SENTINEL
        view = raw[start : start + nbytes].view(values.dtype).reshape(values.shape)
        view[...] = values
        self.buffers.append((raw, start, start + nbytes))
        return view

    def check(self) -> None:
        for raw, start, stop in self.buffers:
            assert (raw[:start] == SENTINEL).all(), "write before an array"
            assert (raw[stop:] == SENTINEL).all(), "write past an array"


def _call(fn: Callable[[], Any], guards: Guarded, outputs: list[np.ndarray]) -> bool:
    """True if the call ran; False if it raised InvalidArgumentError (having written nothing)."""
    before = [o.copy() if isinstance(o, np.ndarray) else None for o in outputs]
    try:
        fn()
    except pagedkv.InvalidArgumentError:
        for o, b in zip(outputs, before, strict=True):
            if b is not None:
                assert np.array_equal(o.view(np.uint8), b.view(np.uint8)), "a rejected call wrote"
        guards.check()
        return False
    except BaseException as error:  # noqa: BLE001 -- nothing else may escape
        pytest.fail(f"raised {type(error).__name__}: {error}")
    guards.check()
    return True


# Mutations that set one element; they run before those that change an array's type or shape.
ELEMENT_MUTATIONS = {
    "table past pool",
    "table negative",
    "table int32 max",
    "len past capacity",
    "len negative",
    "len int32 min",
    "len int32 max",
    "slot -2",
    "slot past pool",
    "slot int64 min",
    "slot int64 max",
    "slot duplicate",
    "slot skip",
}


def _ordered(mutations: list[str]) -> list[str]:
    """Element writes first (they index the arrays as built), conversions to a Python list last
    (no other mutation takes a list: "q list" then "q f64" would break the test, not the call)."""
    return sorted(mutations, key=lambda name: (name not in ELEMENT_MUTATIONS, name.endswith(" list")))


def _readonly(x: Any) -> Any:
    if not isinstance(x, np.ndarray):  # an earlier mutation made it a non-array
        return x
    view = x.view()
    view.flags.writeable = False
    return view


# --------------------------------------------------------------------------- paged_attention


def _valid_attention(rng: np.random.Generator, g: Guarded, dtype: Any, group: int) -> dict[str, Any]:
    seq_lens = [int(n) for n in rng.integers(0, 3 * BLOCK_SIZE, size=2)]
    max_blocks = 3
    ids = rng.permutation(NUM_BLOCKS).astype(np.int32)
    tables = np.full((2, max_blocks), -1, dtype=np.int32)
    tables[0, :3] = ids[:3]
    tables[1, :3] = ids[3:6]
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return dict(
        q=g.array(rng.standard_normal((2, NUM_KV_HEADS * group, HEAD_DIM)).astype(dtype)),
        k_cache=g.array(rng.standard_normal(shape).astype(dtype)),
        v_cache=g.array(rng.standard_normal(shape).astype(dtype)),
        block_tables=g.array(tables),
        seq_lens=g.array(np.array(seq_lens, dtype=np.int32)),
    )


ATTENTION_MUTATIONS: dict[str, Callable[[dict[str, Any]], None]] = {
    "q f64": lambda a: a.update(q=a["q"].astype(np.float64)),
    "q 2-D": lambda a: a.update(q=a["q"][0]),
    "q non-contiguous": lambda a: a.update(q=np.repeat(a["q"], 2, axis=-1)[..., ::2]),
    "q read-only": lambda a: a.update(q=_readonly(a["q"])),
    "q list": lambda a: a.update(q=a["q"].tolist()),
    "q 3 heads": lambda a: a.update(q=np.ascontiguousarray(np.repeat(a["q"], 3, axis=1))),
    "q 16 heads": lambda a: a.update(q=np.ascontiguousarray(np.repeat(a["q"], 16, axis=1))),
    "v dtype": lambda a: a.update(
        v_cache=a["v_cache"].astype(np.float32 if a["v_cache"].dtype != np.float32 else np.float16)
    ),
    "v shape": lambda a: a.update(v_cache=np.ascontiguousarray(a["v_cache"][:-1])),
    "k int": lambda a: a.update(k_cache=a["k_cache"].astype(np.int16)),
    "k 3-D": lambda a: a.update(k_cache=a["k_cache"][0]),
    "table past pool": lambda a: a["block_tables"].__setitem__((0, 0), NUM_BLOCKS),
    "table negative": lambda a: a["block_tables"].__setitem__((1, 0), -1),
    "table int32 max": lambda a: a["block_tables"].__setitem__((0, 0), 2**31 - 1),
    "table int64": lambda a: a.update(block_tables=a["block_tables"].astype(np.int64)),
    "table uint32": lambda a: a.update(block_tables=a["block_tables"].astype(np.uint32)),
    "table non-contiguous": lambda a: a.update(
        block_tables=np.repeat(a["block_tables"], 2, axis=-1)[..., ::2]
    ),
    "table 1-D": lambda a: a.update(block_tables=a["block_tables"][0]),
    "table one row": lambda a: a.update(block_tables=a["block_tables"][:1]),
    "table no columns": lambda a: a.update(block_tables=np.zeros((2, 0), np.int32)),
    "len past capacity": lambda a: a["seq_lens"].__setitem__(0, 3 * BLOCK_SIZE + 1),
    "len negative": lambda a: a["seq_lens"].__setitem__(1, -1),
    "len int32 min": lambda a: a["seq_lens"].__setitem__(1, -(2**31)),
    "len int32 max": lambda a: a["seq_lens"].__setitem__(0, 2**31 - 1),
    "len int64": lambda a: a.update(seq_lens=a["seq_lens"].astype(np.int64)),
    "len 0-d": lambda a: a.update(seq_lens=np.array(3, np.int32)),
    "len scalar": lambda a: a.update(seq_lens=np.int32(3)),
    "scale nan": lambda a: a.update(scale=float("nan")),
    "scale inf": lambda a: a.update(scale=float("-inf")),
    "scale huge int": lambda a: a.update(scale=10**400),
    "scale str": lambda a: a.update(scale="1"),
    "scale bool": lambda a: a.update(scale=True),
    "scale numpy": lambda a: a.update(scale=np.float32(0.5)),
    "splits 0": lambda a: a.update(num_splits=0),
    "splits negative": lambda a: a.update(num_splits=-3),
    "splits huge": lambda a: a.update(num_splits=2**70),
    "splits float": lambda a: a.update(num_splits=2.0),
    "splits uint64": lambda a: a.update(num_splits=np.uint64(2**64 - 1)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    dtype=st.sampled_from([np.float16, np.float32]),
    group=st.sampled_from([1, 2]),
    mutations=st.lists(st.sampled_from(sorted(ATTENTION_MUTATIONS)), max_size=2, unique=True),
)
@example(seed=0, dtype=np.float16, group=1, mutations=["q list", "q f64"])  # found by CI once
def test_paged_attention_fuzz(backend: str, seed: int, dtype: Any, group: int, mutations: list[str]) -> None:
    g = Guarded()
    args = _valid_attention(np.random.default_rng(seed), g, dtype, group)
    for name in _ordered(mutations):
        ATTENTION_MUTATIONS[name](args)
    if backend == "numpy":
        args.pop("num_splits", None)
    ran = _call(lambda: paged_attention(**args, backend=backend), g, [])
    benign = {"q read-only", "scale numpy", "splits huge", "splits uint64", "table no columns"}
    if not set(mutations) - benign and not (
        "table no columns" in mutations and int(np.max(args["seq_lens"])) > 0
    ):
        assert ran, f"a valid call was rejected: {mutations}"


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    mutation=st.sampled_from(
        ["none", "k non-contiguous", "k list", "v shorter", "q 1-D", "k read-only", "empty", "scale huge int"]
    ),
)
def test_contiguous_attention_fuzz(backend: str, seed: int, mutation: str) -> None:
    rng = np.random.default_rng(seed)
    g = Guarded()
    q = g.array(rng.standard_normal((2, HEAD_DIM)).astype(np.float16))
    k = g.array(rng.standard_normal((5, 1, HEAD_DIM)).astype(np.float16))
    v = g.array(rng.standard_normal((5, 1, HEAD_DIM)).astype(np.float16))
    kwargs: dict[str, Any] = {}
    if mutation == "k non-contiguous":
        k = np.repeat(k, 2, axis=0)[::2]
    elif mutation == "k list":
        k = k.tolist()
    elif mutation == "v shorter":
        v = v[:3]
    elif mutation == "q 1-D":
        q = q[0]
    elif mutation == "k read-only":
        k = _readonly(k)
    elif mutation == "empty":
        k, v = k[:0], v[:0]
    elif mutation == "scale huge int":
        kwargs["scale"] = -(10**400)
    ran = _call(lambda: contiguous_attention(q, k, v, backend=backend, **kwargs), g, [])
    if mutation in ("none", "k non-contiguous", "k read-only", "empty"):
        assert ran


# --------------------------------------------------------------------------- write_kv

WRITE_MUTATIONS: dict[str, Callable[[dict[str, Any]], None]] = {
    "slot -2": lambda a: a["slot_mapping"].__setitem__(0, -2),
    "slot past pool": lambda a: a["slot_mapping"].__setitem__(1, NUM_BLOCKS * BLOCK_SIZE),
    "slot int64 min": lambda a: a["slot_mapping"].__setitem__(0, -(2**63)),
    "slot int64 max": lambda a: a["slot_mapping"].__setitem__(0, 2**63 - 1),
    "slot duplicate": lambda a: a["slot_mapping"].__setitem__(1, a["slot_mapping"][0]),
    "slot skip": lambda a: a["slot_mapping"].__setitem__(1, -1),
    "slots int32": lambda a: a.update(slot_mapping=a["slot_mapping"].astype(np.int32)),
    "slots uint64": lambda a: a.update(slot_mapping=a["slot_mapping"].astype(np.uint64)),
    "slots short": lambda a: a.update(slot_mapping=a["slot_mapping"][:-1]),
    "slots 2-D": lambda a: a.update(slot_mapping=a["slot_mapping"][None]),
    "slots non-contiguous": lambda a: a.update(slot_mapping=np.repeat(a["slot_mapping"], 2)[::2]),
    "k_cache read-only": lambda a: a.update(k_cache=_readonly(a["k_cache"])),
    "v_cache read-only": lambda a: a.update(v_cache=_readonly(a["v_cache"])),
    "k read-only": lambda a: a.update(k=_readonly(a["k"])),
    "v dtype": lambda a: a.update(v=a["v"].astype(np.float64)),
    "v fewer tokens": lambda a: a.update(v=a["v"][:-1]),
    "k heads": lambda a: a.update(k=np.ascontiguousarray(np.repeat(a["k"], 2, axis=1))),
    "k non-contiguous": lambda a: a.update(k=np.repeat(a["k"], 2, axis=0)[::2]),
    "cache non-contiguous": lambda a: a.update(k_cache=a["k_cache"][::2], v_cache=a["v_cache"][::2]),
    "caches differ": lambda a: a.update(v_cache=np.ascontiguousarray(a["v_cache"][:-1])),
    "k_cache list": lambda a: a.update(k_cache=[a["k_cache"]]),
}


def _valid_write(rng: np.random.Generator, g: Guarded, dtype: Any) -> dict[str, Any]:
    num_tokens = 4
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    slots = rng.choice(NUM_BLOCKS * BLOCK_SIZE, size=num_tokens, replace=False).astype(np.int64)
    return dict(
        k=g.array(rng.standard_normal((num_tokens, NUM_KV_HEADS, HEAD_DIM)).astype(dtype)),
        v=g.array(rng.standard_normal((num_tokens, NUM_KV_HEADS, HEAD_DIM)).astype(dtype)),
        k_cache=g.array(np.zeros(shape, dtype)),
        v_cache=g.array(np.zeros(shape, dtype)),
        slot_mapping=g.array(slots),
    )


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    dtype=st.sampled_from([np.float16, np.float32]),
    mutations=st.lists(st.sampled_from(sorted(WRITE_MUTATIONS)), max_size=2, unique=True),
)
def test_write_kv_fuzz(backend: str, seed: int, dtype: Any, mutations: list[str]) -> None:
    g = Guarded()
    args = _valid_write(np.random.default_rng(seed), g, dtype)
    for name in _ordered(mutations):
        WRITE_MUTATIONS[name](args)
    outputs = [args["k_cache"], args["v_cache"]]
    ran = _call(lambda: write_kv(**args, backend=backend), g, outputs)
    if {"k_cache read-only", "v_cache read-only"} & set(mutations):
        assert not ran, "wrote into a read-only cache"
    if not set(mutations) - {"slot skip", "k read-only"}:
        assert ran, f"a valid call was rejected: {mutations}"


# --------------------------------------------------------------------------- copy / swap


def _cache(g: Guarded, rng: np.random.Generator, num_blocks: int = NUM_BLOCKS) -> np.ndarray:
    return g.array(rng.standard_normal((num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)).astype(np.float16))


BLOCK_PAIRS: dict[str, Any] = {
    "valid": [[0, 1], [2, 3]],
    "self copy": [[4, 4]],
    "chain": [[0, 1], [1, 2], [2, 0]],
    "empty": np.zeros((0, 2), np.int32),
    "src past pool": [[NUM_BLOCKS, 0]],
    "dst past pool": [[0, NUM_BLOCKS]],
    "negative": [[-1, 0]],
    "int32 min": [[0, -(2**31)]],
    "int32 max": [[2**31 - 1, 0]],
    "int64": np.array([[0, 1]], np.int64),
    "1-D": np.array([0, 1], np.int32),
    "three columns": np.array([[0, 1, 2]], np.int32),
    "non-contiguous": np.array([[0, 9, 1], [2, 9, 3]], np.int32)[:, ::2],
    "fortran": np.asfortranarray(np.array([[0, 1], [2, 3]], np.int32)),
    "list": [[0, 1]],
}


def _pairs(name: str) -> Any:
    value = BLOCK_PAIRS[name]
    if name == "list":
        return value
    return value if isinstance(value, np.ndarray) else np.array(value, dtype=np.int32)


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    pairs=st.sampled_from(sorted(BLOCK_PAIRS)),
    layers=st.sampled_from(["two", "mismatched count", "layer shape differs", "read-only", "tuple", "none"]),
)
def test_copy_blocks_fuzz(backend: str, seed: int, pairs: str, layers: str) -> None:
    rng = np.random.default_rng(seed)
    g = Guarded()
    k_caches = [_cache(g, rng), _cache(g, rng)]
    v_caches = [_cache(g, rng), _cache(g, rng)]
    if layers == "mismatched count":
        v_caches = v_caches[:1]
    elif layers == "layer shape differs":
        k_caches[1] = np.ascontiguousarray(k_caches[1][:-1])
        v_caches[1] = np.ascontiguousarray(v_caches[1][:-1])
    elif layers == "read-only":
        v_caches[1] = _readonly(v_caches[1])
    elif layers == "none":
        k_caches, v_caches = [], []
    call_k: Any = tuple(k_caches) if layers == "tuple" else k_caches
    call_v: Any = tuple(v_caches) if layers == "tuple" else v_caches
    ops = _pairs(pairs)
    expected = [c.copy() for c in (*k_caches, *v_caches)]
    ran = _call(lambda: copy_blocks(call_k, call_v, ops, backend=backend), g, [*k_caches, *v_caches])
    if layers == "read-only":
        assert not ran, "wrote into a read-only cache"
    if pairs in ("valid", "self copy", "chain", "empty") and layers in ("two", "tuple"):
        assert ran
        for src, dst in np.asarray(ops).tolist():  # the copies take effect in order
            for cache in expected:
                cache[dst] = cache[src]
        for cache, want in zip((*k_caches, *v_caches), expected, strict=True):
            assert np.array_equal(cache, want)


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    pairs=st.sampled_from(sorted(BLOCK_PAIRS)),
    caches=st.sampled_from(
        [
            "distinct",
            "same",
            "overlapping views",
            "dst read-only",
            "dst smaller",
            "dtype differs",
            "block shape differs",
            "src empty",
        ]
    ),
)
def test_swap_blocks_fuzz(backend: str, seed: int, pairs: str, caches: str) -> None:
    rng = np.random.default_rng(seed)
    g = Guarded()
    src = _cache(g, rng)
    dst = _cache(g, rng, NUM_BLOCKS + 2)
    if caches == "same":
        dst = src
    elif caches == "overlapping views":
        src, dst = dst[:4], dst[3:]
    elif caches == "dst read-only":
        dst = _readonly(dst)
    elif caches == "dst smaller":
        dst = np.ascontiguousarray(dst[:2])
    elif caches == "dtype differs":
        dst = dst.astype(np.float32)
    elif caches == "block shape differs":
        dst = np.ascontiguousarray(dst[:, :4])
    elif caches == "src empty":
        src = src[:0]
    mapping = _pairs(pairs)
    expected = dst.copy()
    ran = _call(lambda: swap_blocks(src, dst, mapping, backend=backend), g, [dst])
    if caches == "dst read-only":
        assert not ran, "wrote into a read-only cache"
    if pairs in ("valid", "empty") and caches == "distinct":
        assert ran
        for s, d in np.asarray(mapping).tolist():
            expected[d] = src[s]
        assert np.array_equal(dst, expected)


class _RecordingRunner:
    xp = np
    poison = False
    num_sms = 1

    def __init__(self) -> None:
        self.copies: list[tuple[int, int, int]] = []

    def memcpy(self, dst_address: int, src_address: int, num_bytes: int) -> None:
        self.copies.append((dst_address, src_address, num_bytes))

    def address(self, array: np.ndarray) -> int:
        return int(array.ctypes.data)


def test_swap_launch_refuses_runs_outside_the_caches() -> None:
    """swap_blocks' raw copies bypass the harness's bounds check: the launcher checks each run
    itself, so a mapping that slipped past validation cannot copy outside the caches."""
    from pagedkv.attention import kernel_launch

    rng = np.random.default_rng(0)
    g = Guarded()
    src, dst = _cache(g, rng, 2), _cache(g, rng, 2)
    runner = _RecordingRunner()
    with pytest.raises(pagedkv.InvariantViolation):
        kernel_launch.swap_blocks(runner, src, dst, np.array([[1, 1], [2, 2]], np.int32))
    assert runner.copies == []
    assert kernel_launch.swap_blocks(runner, src, dst, np.array([[0, 0], [1, 1]], np.int32)) == 1
