"""Lists of ids are read straight from CPython's object memory once the layout is proved at
import (rust/pagedkv-python/src/int_list/direct.rs); tuples always take the C-API path. A list
must give exactly what the same ids as a tuple give: tables, hit counts, and for bad input the
same error type and message, with nothing changed. The reader must also be ON where it can be,
or these comparisons would only compare the C-API path with itself. scripts/test.sh runs this
file again on the bindings built without the cargo feature `direct-int-reader` (with
``PAGEDKV_INT_LIST_READER=api``: there every list takes the C-API path).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pagedkv
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_test_helpers import snapshot
from pagedkv import _core

BS = 4

# Every digit-count boundary of 30-bit digits, both sides of 2**32, 2**60 (the reader's limit),
# 2**63 and 2**64, and negatives.
BOUNDARIES = [
    0,
    1,
    7,
    2**30 - 1,
    2**30,
    2**30 + 1,
    2**31,
    2**32 - 1,
    2**32,
    2**59,
    2**60 - 1,
    2**60,
    2**62,
    2**63 - 1,
    2**63,
    2**64 - 1,
    2**64,
    10**30,
    -1,
    -(2**30),
    -(2**60),
    -(10**30),
]


class MyInt(int):
    """An int subclass: same memory layout, but must take the checked path."""


# Items the reader must hand to the checked path (or that it refuses) wherever they appear.
ODD_ITEMS: list[Any] = [
    True,
    False,
    MyInt(5),
    MyInt(2**31),
    np.int64(5),
    np.uint32(2**31),
    np.int32(-1),
    1.0,
    2.5,
    None,
    "1",
]

PEER_SYSTEM_PROMPT = list(range(2_000_000_000, 2_000_000_000 + 40))  # two-digit ids, as W2's


def manager() -> pagedkv.KvCacheManager:
    return pagedkv.KvCacheManager(
        num_blocks=64, block_size=BS, enable_prefix_caching=True, num_host_blocks=64
    )


def outcome(call: Callable[[], Any]) -> tuple[Any, ...]:
    """What a call returned, or its error's type, message and notes (arrays as lists)."""
    try:
        result = call()
    except Exception as err:  # every error type is compared
        return ("error", type(err), str(err), getattr(err, "__notes__", None))
    if isinstance(result, tuple):
        return ("ok", tuple(r.tolist() if isinstance(r, np.ndarray) else r for r in result))
    return ("ok", result.tolist() if isinstance(result, np.ndarray) else result)


def live(kv: pagedkv.KvCacheManager, seq_ids: list[int]) -> dict[str, Any]:
    return snapshot(kv, [s for s in seq_ids if isinstance(s, int) and 0 <= s < 2**64])


FORCED_API = os.environ.get("PAGEDKV_INT_LIST_READER") == "api"


@pytest.mark.skipif(FORCED_API, reason="this run is the C-API one")
def test_the_c_api_fallback_gives_the_same_answers() -> None:
    """The same comparisons with the direct reader off (``PAGEDKV_INT_LIST_READER=api``): every
    list then goes through the C-API path of the one reader, which must agree with tuples."""
    here = Path(__file__).resolve().parent
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            "import pagedkv._core as c; assert c._int_list_reader() == 'api', c._int_list_reader()",
        ],
        env={**os.environ, "PAGEDKV_INT_LIST_READER": "api"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x"]
        + [str(here / "test_int_list_reader.py"), str(here / "test_token_arrays.py")],
        env={**os.environ, "PAGEDKV_INT_LIST_READER": "api"},
        capture_output=True,
        text=True,
        check=False,
        cwd=here,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout


@pytest.mark.skipif(FORCED_API, reason="the direct reader is off on purpose")
def test_the_direct_reader_is_on() -> None:
    """The layout is proved on CPython 3.10-3.14 (GIL builds); 'api' there means the fast path
    silently turned off, or a probe value decoded wrongly."""
    name = _core._int_list_reader()
    assert name in {"api", "cpython-3.10", "cpython-3.12"}
    gil = getattr(sys, "_is_gil_enabled", lambda: True)()
    if sys.implementation.name != "cpython" or not (3, 10) <= sys.version_info[:2] <= (3, 14):
        pytest.skip(f"no layout is claimed for {sys.implementation.name} {sys.version_info[:2]}")
    if not gil:
        pytest.skip("free-threaded interpreter: the reader stays off")
    assert name == ("cpython-3.10" if sys.version_info < (3, 12) else "cpython-3.12")


def assert_same_admission(
    a: pagedkv.KvCacheManager, b: pagedkv.KvCacheManager, seq_id: int, ids: list[Any]
) -> None:
    """`ids` admitted as a list on `a` and as a tuple on `b` (and appended to) agree."""
    got = outcome(lambda: a.add_sequence(seq_id, list(ids)))
    assert got == outcome(lambda: b.add_sequence(seq_id, tuple(ids))), ids
    if got[0] == "ok":
        assert a.block_table(seq_id).tolist() == b.block_table(seq_id).tolist()
        assert a.num_tokens(seq_id) == b.num_tokens(seq_id) == len(ids)
        tail = ids[-3:]
        assert outcome(lambda: a.append_tokens(seq_id, list(tail))) == outcome(
            lambda: b.append_tokens(seq_id, tuple(tail))
        )
    assert live(a, [seq_id]) == live(b, [seq_id])
    a.check_invariants()
    b.check_invariants()


@pytest.mark.parametrize("value", BOUNDARIES + ODD_ITEMS, ids=repr)
@pytest.mark.parametrize("where", ["alone", "first", "last", "inline", "middle"])
def test_token_list_matches_tuple(value: Any, where: str) -> None:
    a, b = manager(), manager()
    for kv in (a, b):
        kv.add_sequence(1, PEER_SYSTEM_PROMPT)  # a cached prefix to hit
    prompts = {
        "alone": [value],
        "first": [value, *PEER_SYSTEM_PROMPT],
        "last": [*PEER_SYSTEM_PROMPT, value],
        "inline": [3, value, 5, 6],  # <= 8 items: the stack buffer
        "middle": [*PEER_SYSTEM_PROMPT[:20], value, *PEER_SYSTEM_PROMPT[20:]],
    }
    assert_same_admission(a, b, 2, prompts[where])


@pytest.mark.parametrize("length", [0, 1, 2, 8, 9, 40, 1324])
def test_valid_lists_of_every_length(length: int) -> None:
    ids = [BOUNDARIES[i % 8] for i in range(length)]  # 0 .. 2**32 - 1: valid token ids
    a, b = manager(), manager()
    if length <= 64 * BS:
        assert_same_admission(a, b, 3, ids)
        assert_same_admission(a, b, 4, ids)  # a hit on the first
    else:
        assert_same_admission(a, b, 3, ids)  # refused unread: more than the pool holds


SEQ_IDS = [0, 1, 7, 2**30 - 1, 2**30, 2**32, 2**60 - 1, 2**60, 2**63 - 1, 2**63, 2**64 - 2, 2**64 - 1]


@pytest.mark.parametrize(
    "extra",
    [[], [2**64], [-1], [True], [MyInt(7)], [np.uint64(2**64 - 1)], [1.0], [10**30], [5], [7]],
    ids=repr,
)
def test_seq_id_lists_match_tuples(extra: list[Any]) -> None:
    """u64 ids near 2**63 and 2**64 (three digits: the whole call takes the C-API path), bad
    ids, unknown ids and duplicates: every batch reader agrees list vs tuple."""
    a, b = manager(), manager()
    for kv in (a, b):
        for seq_id in SEQ_IDS:
            kv.add_sequence(seq_id, [seq_id % 1000, 2_000_000_000])
    batch = SEQ_IDS[::2] + extra
    for name, args in [
        ("batch_block_tables", ()),
        ("csr_page_table", ()),
        ("slot_mapping", (1,)),
        ("append_tokens_batch", ()),
        ("swap_out", ()),
        ("free_batch", ()),
    ]:
        got = outcome(partial(getattr(a, name), list(batch), *args))
        assert got == outcome(partial(getattr(b, name), tuple(batch), *args)), name
        assert live(a, SEQ_IDS) == live(b, SEQ_IDS), name
        a.check_invariants()
        b.check_invariants()


def test_tokens_batch_with_list_ids() -> None:
    a, b = manager(), manager()
    seqs = [2**60 - 1, 2**30, 5]
    for kv in (a, b):
        for s in seqs:
            kv.add_sequence(s, [1, 2])
    tokens = [2**32 - 1, 2**30, 0]
    got = outcome(lambda: a.append_tokens_batch(list(seqs), list(tokens)))
    assert got == outcome(lambda: b.append_tokens_batch(tuple(seqs), tuple(tokens))) == ("ok", None)
    assert live(a, seqs) == live(b, seqs)


token = st.one_of(
    st.integers(0, 2**32 - 1),
    st.integers(2**30 - 3, 2**30 + 3),
    st.integers(2_000_000_000, 2_000_000_100),
    st.sampled_from([0, 1, 2**31, 2**32 - 1]),
)
odd = st.one_of(st.sampled_from(BOUNDARIES + ODD_ITEMS), st.integers(-(2**70), 2**70))


@settings(max_examples=150)
@given(
    prompts=st.lists(
        st.tuples(
            st.lists(token, max_size=30),
            st.integers(0, 3),  # 0: a fresh prompt, else re-admit an earlier one (a hit)
            st.lists(st.tuples(st.integers(0, 30), odd), max_size=1),  # at most one odd item
        ),
        min_size=1,
        max_size=6,
    ),
    free_ids=st.lists(
        st.one_of(st.integers(0, 8), st.sampled_from([2**63, 2**64 - 1, 2**64, -1])), max_size=4
    ),
)
def test_random_lists_match_tuples(
    prompts: list[tuple[list[int], int, list[tuple[int, Any]]]], free_ids: list[Any]
) -> None:
    a, b = manager(), manager()
    admitted: list[list[Any]] = []
    for seq_id, (fresh, reuse, insert) in enumerate(prompts):
        ids: list[Any] = list(admitted[-reuse] if reuse and len(admitted) >= reuse else fresh)
        for at, item in insert:
            ids.insert(min(at, len(ids)), item)
        assert_same_admission(a, b, seq_id, ids)
        admitted.append(ids)
    got = outcome(lambda: a.free_batch(list(free_ids)))
    assert got == outcome(lambda: b.free_batch(tuple(free_ids)))
    assert live(a, list(range(len(prompts)))) == live(b, list(range(len(prompts))))
    a.check_invariants()
    b.check_invariants()


def test_single_id_arguments_match_the_array_path() -> None:
    """One id argument (`add_sequence(seq_id, ...)`, `num_tokens(seq_id)`) is read in place
    too; the same ids through a uint64 array and through `__index__` name the same sequences."""
    kv = manager()
    valid = [v for v in BOUNDARIES if 0 <= v < 2**64]
    for n, seq_id in enumerate(valid, start=1):
        kv.add_sequence(seq_id, list(range(n)))
    for n, seq_id in enumerate(valid, start=1):
        assert seq_id in kv
        assert kv.num_tokens(seq_id) == kv.num_tokens(np.uint64(seq_id)) == n
        _, lens = kv.batch_block_tables(np.asarray([seq_id], dtype=np.uint64))
        assert lens.tolist() == [n]
    assert kv.num_sequences == len(valid)
    kv.free_batch(np.asarray(valid, dtype=np.uint64))
    assert kv.num_sequences == 0
    kv.check_invariants()


class MyList(list[Any]):
    """A list subclass: its items live where a list's do; overriding `__getitem__` changes
    nothing, on the C-API path as on the direct one."""

    def __getitem__(self, index: Any) -> Any:
        raise AssertionError("not called")


@pytest.mark.parametrize("ids", [[1, 2, 2**31], PEER_SYSTEM_PROMPT, [1, True], [2**32]], ids=repr)
def test_list_subclass_matches_tuple(ids: list[Any]) -> None:
    a, b = manager(), manager()
    got = outcome(lambda: a.add_sequence(1, MyList(ids)))
    assert got == outcome(lambda: b.add_sequence(1, tuple(ids)))
    assert live(a, [1]) == live(b, [1])
    assert outcome(lambda: a.free_batch(MyList([1]))) == outcome(lambda: b.free_batch((1,)))
    a.check_invariants()
