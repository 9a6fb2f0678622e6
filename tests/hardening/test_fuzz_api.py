"""Fuzzing the Python API: random call sequences with valid and junk arguments.

Every call must either succeed or raise a ``pagedkv.PagedKvError`` subclass (never a bare
TypeError / OverflowError / SystemError / PanicException, never a crash); a failed call must
change nothing observable (stats, every block table, refcounts, free counts, pending copy ops,
events); ``check_invariants()`` must pass on every manager and the shared pool after each step.

Three managers are fuzzed together: one with prefix caching and a host tier on its own pool, and
two sharing one ``BlockPool`` (one of them with prefix caching and a host tier too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pagedkv
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis.control import currently_in_test_context
from pagedkv import PagedKvError

NUM_BLOCKS = 12
SHARED_POOL_BLOCKS = 16
NUM_HOST_BLOCKS = 6
# Every valid sequence id the fuzzer uses; snapshots cover all of them.
ID_POOL = [0, 1, 2, 3, 4, 5, 2**63, 2**64 - 1]

INT_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
OTHER_DTYPES = [np.float16, np.float32, np.float64, np.bool_, np.complex64]


def _readonly(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def _gen() -> Any:
    return (i for i in range(3))


# Junk values, each built fresh per call (arrays are mutable).
JUNK_FACTORIES: list[Callable[[], Any]] = [
    lambda: None,
    lambda: True,
    lambda: False,
    lambda: np.bool_(True),
    lambda: -1,
    lambda: -(2**63),
    lambda: 2**64,
    lambda: 2**70,
    lambda: 10**5000,
    lambda: -(10**5000),
    lambda: 1.0,
    lambda: float("nan"),
    lambda: float("inf"),
    lambda: 1 + 2j,
    lambda: "3",
    lambda: "",
    lambda: "\ud800",
    lambda: b"\x00\xff",
    lambda: bytearray(b"ab"),
    lambda: [],
    lambda: (),
    lambda: [[1, 2], [3]],
    lambda: [1, "x"],
    lambda: [1, None],
    lambda: [1.5],
    lambda: [-1],
    lambda: [2**64],
    lambda: [2**32],
    lambda: [True, False],
    lambda: {1: 2},
    lambda: {1, 2},
    lambda: range(4),
    lambda: range(10**18),
    _gen,
    lambda: object(),
    lambda: np.array(3),
    lambda: np.array([[1, 2], [3, 4]], dtype=np.int32),
    lambda: np.arange(8, dtype=np.int64)[::2],
    lambda: np.arange(8, dtype=np.int32)[::-1],
    lambda: _readonly(np.arange(4, dtype=np.int64)),
    lambda: np.array([], dtype=np.int32),
    lambda: np.array([], dtype=np.float64),
    lambda: np.array([1, 2], dtype=">i4"),
    lambda: np.array([1, 2], dtype=">u8"),
    lambda: np.array([-1, 2], dtype=np.int64),
    lambda: np.array([2**64 - 1], dtype=np.uint64),
    lambda: np.array([1, 2], dtype=object),
    lambda: np.array([1.0, 2.0]),
    lambda: np.array([True]),
    lambda: np.zeros((0, 3), dtype=np.int32),
    lambda: np.uint64(2**64 - 1),
    lambda: np.uint64(2**63 + 5),
    lambda: np.int64(-1),
    lambda: np.int8(-128),
    lambda: np.float32(1.0),
    lambda: np.float64(2.0),
    lambda: np.float16(0.0),
    lambda: np.complex64(1),
    lambda: np.datetime64("2024-01-01"),
    lambda: np.str_("1"),
    lambda: pagedkv.BlockPool(num_blocks=2, block_size=2),
    # Every NumPy integer dtype as a scalar and as an array (native byte order).
    *(lambda dtype=dtype: dtype(1) for dtype in INT_DTYPES),
    *(lambda dtype=dtype: np.array([1, 2], dtype=dtype) for dtype in INT_DTYPES),
]

junk = st.sampled_from(JUNK_FACTORIES).map(lambda make: make())


def _as_dtype(value: int, dtype: Any) -> Any:
    try:
        return dtype(value)
    except OverflowError:
        return value


# Biased towards a few ids so that calls meet live sequences often.
LIKELY_IDS = [0, 0, 0, 1, 1, 1, 2, 2, 3, 2**63, 2**64 - 1]
seq_id = st.one_of(
    st.sampled_from(LIKELY_IDS),
    st.sampled_from(LIKELY_IDS),
    st.tuples(st.sampled_from(LIKELY_IDS), st.sampled_from(INT_DTYPES)).map(
        lambda pair: _as_dtype(pair[0], pair[1])
    ),
)
any_seq_id = st.one_of(seq_id, seq_id, seq_id, seq_id, seq_id, junk)

small_count = st.one_of(
    st.integers(0, 12),
    st.integers(8, 40),
    st.integers(0, 12).flatmap(lambda n: st.sampled_from(INT_DTYPES).map(lambda d: d(n))),
    st.sampled_from([2**31, 2**32, 2**63 - 1, 2**64 - 1]),
)
any_count = st.one_of(small_count, small_count, small_count, small_count, junk)

token = st.integers(0, 3)
token_list = st.lists(token, max_size=40)


def _token_container(tokens: list[int], kind: int, dtype: Any) -> Any:
    if kind == 0:
        return tokens
    if kind == 1:
        return tuple(tokens)
    if kind == 2:
        return np.array(tokens, dtype=dtype)
    if kind == 3:  # non-contiguous
        doubled = np.repeat(np.array(tokens, dtype=dtype), 2)
        return doubled[::2]
    if kind == 4:
        return _readonly(np.array(tokens, dtype=dtype))
    return [dtype(t) for t in tokens]  # a list of NumPy scalars


token_ids = st.builds(_token_container, token_list, st.integers(0, 5), st.sampled_from(INT_DTYPES))
any_token_ids = st.one_of(token_ids, token_ids, token_ids, token_ids, st.none(), junk)

seq_id_batch = st.one_of(
    st.lists(st.sampled_from(LIKELY_IDS), max_size=4),
    st.lists(st.sampled_from(LIKELY_IDS), max_size=4, unique=True),
    st.lists(st.sampled_from(ID_POOL[:3]), min_size=2, max_size=4),  # duplicates likely
    st.lists(st.sampled_from(ID_POOL[:6]), max_size=4).map(lambda ids: np.array(ids, dtype=np.int64)),
    st.lists(st.sampled_from(ID_POOL), max_size=4).map(lambda ids: np.array(ids, dtype=np.uint64)),
    st.lists(st.sampled_from(ID_POOL[:6]), max_size=4).map(tuple),
)
any_seq_ids = st.one_of(seq_id_batch, seq_id_batch, seq_id_batch, seq_id_batch, junk)

extra_key = st.one_of(st.none(), st.none(), st.sampled_from(["a", "b", b"a", 5, "5", 2**70, -3]), junk)
block_id = st.one_of(st.integers(0, 20), junk)


def _calls(data: st.DataObject) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    """One method call: (name, positional args, keyword args)."""
    draw = data.draw
    name = draw(
        st.sampled_from(
            [
                *["add_sequence"] * 6,
                *["append_tokens"] * 4,
                "can_append",
                *["append_tokens_batch"] * 3,
                "free_batch",
                "fork",
                "fork",
                "fork",
                "free",
                "free",
                "block_table",
                "num_tokens",
                "batch_block_tables",
                "slot_mapping",
                "take_copy_ops",
                "refcount",
                "swap_out",
                "swap_out",
                "swap_in",
                "swap_in",
                "reset_prefix_cache",
                "take_events",
                "take_event_batch",
                "blocks_needed_for_prompt",
                "is_swapped_out",
                "__contains__",
            ]
        )
    )
    kwargs: dict[str, Any] = {}
    if name == "add_sequence":
        args: tuple[Any, ...] = (draw(any_seq_id),)
        form = draw(st.sampled_from([0, 0, 0, 1, 1, 2, 3]))
        if form in (0, 2):
            kwargs["token_ids"] = draw(any_token_ids)
        if form in (1, 2):
            kwargs["num_tokens"] = draw(any_count)
        if draw(st.booleans()):
            kwargs["extra_key"] = draw(extra_key)
    elif name == "append_tokens":
        args = (draw(any_seq_id),)
        form = draw(st.integers(0, 3))
        if form in (0, 2):
            kwargs["token_ids"] = draw(any_token_ids)
        if form in (1, 2):
            kwargs["num_tokens"] = draw(any_count)
    elif name == "can_append":
        args = (draw(any_seq_id), draw(any_count))
    elif name == "append_tokens_batch":
        args = (draw(any_seq_ids),)
        if draw(st.booleans()):
            kwargs["token_ids"] = draw(any_token_ids)
        if draw(st.booleans()):
            kwargs["num_tokens"] = draw(any_count)
    elif name in ("free_batch", "batch_block_tables"):
        args = (draw(any_seq_ids),)
    elif name == "fork":
        args = (draw(any_seq_id), draw(any_seq_id))
    elif name in ("free", "block_table", "num_tokens", "is_swapped_out", "__contains__"):
        args = (draw(any_seq_id),)
    elif name == "slot_mapping":
        args = (draw(any_seq_ids), draw(any_count))
    elif name == "refcount":
        args = (draw(block_id),)
    elif name in ("swap_out", "swap_in"):
        args = (draw(st.one_of(any_seq_id, any_seq_ids)),)
    elif name == "blocks_needed_for_prompt":
        args = (draw(any_count),)
    elif name == "take_event_batch":
        args = (draw(st.one_of(st.floats(), st.integers(-(2**70), 2**70), junk)),)
        if draw(st.booleans()):
            args += (draw(st.one_of(st.none(), st.integers(-(2**70), 2**70), junk)),)
        if draw(st.booleans()):
            kwargs["raw_hashes"] = draw(st.one_of(st.booleans(), junk))
    else:
        args = ()
    return name, args, kwargs


# Methods whose success changes nothing observable.
READ_ONLY = {
    "can_append",
    "block_table",
    "num_tokens",
    "batch_block_tables",
    "slot_mapping",
    "refcount",
    "blocks_needed_for_prompt",
    "is_swapped_out",
    "__contains__",
}


def _snapshot(kv: pagedkv.KvCacheManager) -> dict[str, Any]:
    tables = {}
    for seq in ID_POOL:
        if seq in kv:
            swapped = kv.num_host_blocks > 0 and kv.is_swapped_out(seq)
            table = None if swapped else kv.block_table(seq).tolist()
            tables[seq] = (table, kv.num_tokens(seq), swapped)
    return {
        "tables": tables,
        "len": len(kv),
        "refcounts": [kv.refcount(b) for b in range(kv.num_blocks)],
        "num_free_blocks": kv.num_free_blocks,
        "num_free_host_blocks": kv.num_free_host_blocks,
        "pool_free": kv.pool.num_free_blocks,
        "usage": kv.usage,
        "stats": kv.stats(),
    }


def _check_all(managers: list[pagedkv.KvCacheManager]) -> None:
    for kv in managers:
        kv.check_invariants()
        kv.pool.check_invariants()


def _make_managers() -> list[pagedkv.KvCacheManager]:
    shared = pagedkv.BlockPool(num_blocks=SHARED_POOL_BLOCKS, block_size=2)
    return [
        pagedkv.KvCacheManager(
            num_blocks=NUM_BLOCKS,
            block_size=3,
            enable_prefix_caching=True,
            num_host_blocks=NUM_HOST_BLOCKS,
            enable_kv_events=True,
        ),
        pagedkv.KvCacheManager(
            pool=shared, enable_prefix_caching=True, num_host_blocks=NUM_HOST_BLOCKS, enable_kv_events=True
        ),
        pagedkv.KvCacheManager(pool=shared),
    ]


def _event(text: str) -> None:
    """Outcome statistics (--hypothesis-show-statistics) when run under hypothesis."""
    if currently_in_test_context():
        event(text)


def _call_checked(
    kv: pagedkv.KvCacheManager, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    # Drain what a successful call may legitimately add, so a failed call can be seen to add none.
    kv.take_copy_ops()
    kv.take_events()
    before = _snapshot(kv)
    try:
        getattr(kv, name)(*args, **kwargs)
    except PagedKvError as error:
        _event(f"{name}: {type(error).__name__}")
        assert _snapshot(kv) == before, f"failed {name}{args}{kwargs} changed state"
        assert kv.take_copy_ops().shape == (0, 2), f"failed {name} left copy ops"
        assert kv.take_events() == [], f"failed {name} left events"
    except BaseException as error:  # noqa: BLE001 -- the point: nothing else may escape
        pytest.fail(f"{name}{args!r:.200}{kwargs!r:.200} raised {type(error).__name__}: {error}")
    else:
        _event(f"{name}: ok")
        if name in READ_ONLY:
            assert _snapshot(kv) == before, f"read-only {name} changed state"


FUZZ_SETTINGS = settings(
    max_examples=int(__import__("os").environ.get("FUZZ_EXAMPLES", "300")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@FUZZ_SETTINGS
@given(st.data())
def test_random_call_sequences(data: st.DataObject) -> None:
    managers = _make_managers()
    steps = data.draw(st.integers(1, 60), label="steps")
    for _ in range(steps):
        kv = managers[data.draw(st.sampled_from([0, 0, 0, 1, 1, 2]))]
        name, args, kwargs = _calls(data)
        _call_checked(kv, name, args, kwargs)
        _check_all(managers)


def _constructor_kwargs(data: st.DataObject) -> tuple[dict[str, Any], bool]:
    """Constructor keyword arguments, each omitted, valid or junk; and whether all are valid
    (then the constructors must succeed: refusing everything would pass the junk checks)."""
    draw = data.draw
    kwargs: dict[str, Any] = {}
    all_valid = True
    for key, valid in [
        ("num_blocks", st.integers(1, 64)),
        ("block_size", st.integers(1, 64)),
        ("enable_prefix_caching", st.booleans()),
        ("num_host_blocks", st.integers(0, 64)),
        ("hash_seed", st.integers(0, 2**64 - 1)),
        ("max_events", st.integers(0, 64)),
        ("enable_kv_events", st.booleans()),
    ]:
        choice = draw(st.integers(0, 3))
        if choice == 1:
            kwargs[key] = draw(valid)
        elif choice == 2:
            kwargs[key] = draw(st.one_of(junk, st.sampled_from([2**31, 2**40, 2**62, 2**64 - 1])))
            all_valid = False
    if draw(st.integers(0, 3)) == 0:
        kwargs["pool"] = draw(st.one_of(junk, st.just("pool")))
        if isinstance(kwargs["pool"], str) and kwargs["pool"] == "pool":
            kwargs["pool"] = pagedkv.BlockPool(num_blocks=8, block_size=4)
            # The manager's sizes, when given, must agree with the pool's.
            all_valid = all_valid and kwargs.get("num_blocks", 8) == 8 and kwargs.get("block_size", 4) == 4
        else:
            all_valid = False
    return kwargs, all_valid


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_constructors_take_junk(data: st.DataObject) -> None:
    kwargs, all_valid = _constructor_kwargs(data)
    try:
        kv = pagedkv.KvCacheManager(**kwargs)
    except PagedKvError as error:
        assert not all_valid, f"KvCacheManager(**{kwargs!r:.300}) refused valid arguments: {error}"
    except BaseException as error:  # noqa: BLE001
        pytest.fail(f"KvCacheManager(**{kwargs!r:.300}) raised {type(error).__name__}: {error}")
    else:
        kv.check_invariants()
        repr(kv)
    pool_kwargs = {k: v for k, v in kwargs.items() if k in ("num_blocks", "block_size")}
    pool_valid = all(
        isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 64 for v in pool_kwargs.values()
    )
    try:
        pool = pagedkv.BlockPool(**pool_kwargs)
    except PagedKvError as error:
        assert not pool_valid, f"BlockPool(**{pool_kwargs!r:.300}) refused valid arguments: {error}"
    except BaseException as error:  # noqa: BLE001
        pytest.fail(f"BlockPool(**{pool_kwargs!r:.300}) raised {type(error).__name__}: {error}")
    else:
        pool.check_invariants()
        repr(pool)


valid_block_id = st.one_of(
    st.integers(0, 3),
    st.tuples(st.integers(0, 3), st.sampled_from(INT_DTYPES)).map(lambda pair: pair[1](pair[0])),
)


@settings(max_examples=200, deadline=None)
@given(st.one_of(junk, valid_block_id))
def test_pool_refcount_takes_junk(value: Any) -> None:
    pool = pagedkv.BlockPool(num_blocks=4, block_size=2)
    # A block id: a Python or NumPy integer, or a 0-d integer array (an integer by __index__),
    # not a bool, in [0, 4). The pool is fresh: refcount 0.
    integer = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
    integer |= isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "iu"
    valid = bool(integer and 0 <= value < 4)
    try:
        count = pool.refcount(value)
    except PagedKvError as error:
        assert not valid, f"refcount({value!r}) refused a valid block id: {error}"
    except BaseException as error:  # noqa: BLE001
        pytest.fail(f"refcount({value!r:.100}) raised {type(error).__name__}: {error}")
    else:
        assert valid, f"refcount({value!r:.100}) accepted an invalid block id"
        assert count == 0
    pool.check_invariants()


# Each of these once made a call escape with a non-pagedkv exception (kept as named cases).
@pytest.mark.parametrize(
    "name, args, kwargs",
    [
        ("add_sequence", (1, [1, 2]), {"extra_key": "\ud800"}),
        ("add_sequence", (1, [1, 2]), {"extra_key": 10**5000}),
    ],
)
def test_regressions(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    for kv in _make_managers():
        _call_checked(kv, name, args, kwargs)
        kv.check_invariants()


def test_alphabet_is_exercised() -> None:
    """The junk list covers every NumPy integer dtype, as a scalar and an array (a guard so the
    fuzzer cannot silently lose coverage)."""
    values = [make() for make in JUNK_FACTORIES]
    assert any(isinstance(v, np.ndarray) and not v.flags.c_contiguous for v in values)
    assert any(isinstance(v, np.ndarray) and not v.flags.writeable for v in values)
    assert any(isinstance(v, np.ndarray) and v.ndim == 0 for v in values)
    assert any(isinstance(v, np.uint64) and int(v) > 2**63 for v in values)
    for dtype in INT_DTYPES:
        assert any(type(v) is dtype for v in values), f"no {dtype.__name__} scalar"
        assert any(isinstance(v, np.ndarray) and v.dtype == dtype and v.ndim == 1 for v in values), (
            f"no {dtype.__name__} array"
        )
