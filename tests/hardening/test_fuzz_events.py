"""The fuzz harness extended to the KV-event encoder and publisher.

Events whose fields are junk of any type (huge and negative ints, floats, bools, lone surrogates,
bytes, nested lists, NumPy scalars, objects whose ``__index__`` raises or returns junk) must give
``encode_batch`` bytes or a typed pagedkv error, never another exception; an exception that must
propagate (guarantee 5) comes back as the very object raised. The publisher raises the same
errors on the caller's thread and keeps publishing good batches in order afterwards.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pagedkv
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored, encode_batch

msgspec = pytest.importorskip("msgspec")

PROPAGATING = (SystemExit(3), KeyboardInterrupt(), MemoryError())


class Index:
    """``__index__`` returns ``value`` or raises it."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __index__(self) -> Any:
        if isinstance(self.value, BaseException):
            raise self.value
        return self.value


class Raising:
    """Raises on every attribute access other than its own (junk of a hostile kind)."""

    def __len__(self) -> int:
        raise ValueError("no length")

    def __iter__(self) -> Any:
        raise RuntimeError("no iteration")


scalars = st.one_of(
    st.integers(min_value=-(1 << 130), max_value=1 << 130),
    st.integers(min_value=0, max_value=1 << 20),
    st.floats(allow_nan=True),
    st.booleans(),
    st.none(),
    st.text(alphabet=st.characters(codec=None, min_codepoint=0xD7F0, max_codepoint=0xE010), max_size=4),
    st.text(max_size=4),
    st.binary(max_size=4),
    st.builds(np.int64, st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1)),
    st.builds(np.float32, st.floats(width=32)),
    st.builds(Index, st.integers(min_value=-5, max_value=1 << 70)),
    st.builds(Index, st.sampled_from([ValueError("bad"), TypeError("bad"), OverflowError("bad"), "str"])),
    st.builds(Raising),
)
fields = st.one_of(scalars, st.lists(scalars, max_size=4), st.tuples(scalars, scalars))
extra_keys = st.one_of(
    st.none(), st.lists(st.one_of(st.none(), st.tuples(scalars), fields), max_size=3), fields
)


def good_or(strategy: st.SearchStrategy[Any], good: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(good, strategy)


ids = st.lists(st.integers(min_value=0, max_value=(1 << 64) - 1), max_size=4)
stored = st.builds(
    BlockStored,
    block_hashes=good_or(fields, ids),
    parent_block_hash=good_or(scalars, st.none()),
    token_ids=good_or(fields, ids),
    block_size=good_or(scalars, st.integers(min_value=1, max_value=64)),
    lora_id=good_or(scalars, st.none()),
    medium=good_or(scalars, st.sampled_from(["GPU", "CPU", None])),
    lora_name=good_or(scalars, st.none()),
    extra_keys=extra_keys,
)
removed = st.builds(BlockRemoved, block_hashes=good_or(fields, ids), medium=good_or(scalars, st.just("GPU")))
events = st.lists(st.one_of(stored, removed, st.just(AllBlocksCleared()), scalars), max_size=4)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=events, propagate=st.one_of(st.none(), st.sampled_from(range(len(PROPAGATING)))))
def test_encode_batch_gives_bytes_or_a_typed_error(batch: list[Any], propagate: int | None) -> None:
    error = None if propagate is None else PROPAGATING[propagate]
    if error is not None:
        batch = [BlockRemoved(block_hashes=[1, Index(error)]), *batch]  # type: ignore[list-item]
    try:
        payload = encode_batch(batch, ts=0.0, data_parallel_rank=0)
    except pagedkv.PagedKvError:
        assert error is None
        return
    except BaseException as caught:  # noqa: BLE001 - judged here
        assert error is not None and caught is error, repr(caught)
        return
    assert error is None
    ts, decoded, rank = msgspec.msgpack.decode(payload)
    assert (ts, rank, len(decoded)) == (0.0, 0, len(batch))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches=st.lists(events, min_size=1, max_size=4))
def test_the_publisher_refuses_junk_on_the_caller_and_keeps_order(batches: list[list[Any]]) -> None:
    from pagedkv.events import ZmqEventPublisher

    with ZmqEventPublisher("inproc://fuzz-events") as pub:
        sent = 0
        for batch in batches:
            try:
                pub.publish(batch)
            except pagedkv.PagedKvError:
                continue
            sent += 1
        assert pub.flush(60.0)  # a hang guard: flush returns once the batches are sent
        assert (pub.published_batches, pub.failed_batches, pub.last_error) == (sent, 0, None)
