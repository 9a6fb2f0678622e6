"""pagedkv.events.encode_batch against vLLM's schema: msgspec decodes our bytes with vLLM's struct
definitions (tests/events/vllm_kv_events_schema.py), and msgspec *encoding* the same events with
those structs gives byte-for-byte the same payload."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import pagedkv
import pytest
from pagedkv.errors import InvalidArgumentError, InvalidArgumentTypeError
from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, encode_batch

msgspec = pytest.importorskip("msgspec")
from vllm_kv_events_schema import DECODER, ENCODER, Batch, Cleared, Removed, Stored  # noqa: E402

LOW_64 = (1 << 64) - 1


def as_vllm(event: KvEvent, raw: bool = False) -> Stored | Removed | Cleared:
    """The vLLM struct a vLLM engine would have published for ``event``."""

    def wire(h: int) -> int | bytes:
        return h.to_bytes(16, "big") if raw else h & LOW_64

    if isinstance(event, BlockStored):
        return Stored(
            block_hashes=[wire(h) for h in event.block_hashes],
            parent_block_hash=None if event.parent_block_hash is None else wire(event.parent_block_hash),
            token_ids=list(event.token_ids),
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=event.medium,
            lora_name=event.lora_name,
            extra_keys=event.extra_keys,
            group_idx=event.group_idx,
        )
    if isinstance(event, BlockRemoved):
        return Removed(
            block_hashes=[wire(h) for h in event.block_hashes], medium=event.medium, group_idx=event.group_idx
        )
    return Cleared()


def workload_events(seed: int) -> list[KvEvent]:
    """Stores, hits, evictions, a salted sequence and a reset from a small prefix-caching pool."""
    events: list[KvEvent] = []
    drive_workload(seed, lambda kv: events.extend(kv.take_events()))
    return events


def drive_workload(seed: int, drain: Callable[[pagedkv.KvCacheManager], object]) -> None:
    """The workload of ``workload_events``, calling ``drain(kv)`` where it drains events (before
    the reset and at the end)."""
    rng = random.Random(seed)
    kv = pagedkv.KvCacheManager(
        num_blocks=24, block_size=4, enable_prefix_caching=True, enable_kv_events=True, hash_seed=seed
    )
    prefixes = [[rng.randrange(50_000) for _ in range(8)] for _ in range(3)]
    seq = 0
    for step in range(40):
        prompt = rng.choice(prefixes) + [rng.randrange(50_000) for _ in range(rng.randrange(0, 9))]
        salt = b"tenant-a" if step % 7 == 3 else None
        try:
            kv.add_sequence(seq, prompt, extra_key=salt)
        except pagedkv.OutOfBlocksError:
            pass
        else:
            kv.free(seq)
        seq += 1
        if step == 30:
            drain(kv)
            assert kv.reset_prefix_cache()
    drain(kv)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("rank", "raw"), [(None, False), (3, True)])
def test_take_event_batch_is_encode_batch_of_take_events(seed: int, rank: int | None, raw: bool) -> None:
    # Two managers driven identically: one drains objects and encodes them, the other drains
    # straight to bytes (what ZmqEventPublisher.drain sends); every payload is the same.
    encoded: list[tuple[int, bytes]] = []
    direct: list[tuple[int, bytes]] = []

    def via_objects(kv: pagedkv.KvCacheManager) -> None:
        events = kv.take_events()
        encoded.append((len(events), encode_batch(events, ts=7.25, data_parallel_rank=rank, raw_hashes=raw)))

    drive_workload(seed, via_objects)
    drive_workload(seed, lambda kv: direct.append(kv.take_event_batch(7.25, rank, raw)))
    assert direct == encoded
    assert all(count > 0 for count, _ in direct)
    decoded = [DECODER.decode(payload) for _, payload in direct]
    assert [len(batch.events) for batch in decoded] == [count for count, _ in direct]
    assert {type(e) for batch in decoded for e in batch.events} == {Stored, Removed, Cleared}


def test_take_event_batch_when_empty_and_with_a_bad_rank() -> None:
    kv = pagedkv.KvCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True, enable_kv_events=True)
    count, payload = kv.take_event_batch(1.0)
    assert count == 0 and DECODER.decode(payload).events == []
    kv.add_sequence(1, list(range(10)))
    for bad in (True, 1.5, "0", 2**64):
        with pytest.raises(pagedkv.InvalidArgumentError, match="data_parallel_rank"):
            kv.take_event_batch(1.0, bad)  # type: ignore[arg-type]
    for bad_ts in (None, "1.0", True, 10**400):
        with pytest.raises(pagedkv.InvalidArgumentError, match="ts"):
            kv.take_event_batch(bad_ts)  # type: ignore[arg-type]
    with pytest.raises(pagedkv.InvalidArgumentError, match="bool"):
        kv.take_event_batch(1.0, None, 1)  # type: ignore[arg-type]
    count, payload = kv.take_event_batch(1.0, 0)  # the refusals drained nothing
    assert count == 1 and DECODER.decode(payload).data_parallel_rank == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("raw", [False, True])
def test_vllm_structs_decode_our_bytes_and_encode_the_same_bytes(seed: int, raw: bool) -> None:
    events = workload_events(seed)
    kinds = {type(e) for e in events}
    assert kinds == {BlockStored, BlockRemoved, AllBlocksCleared}  # the workload covers all three
    assert any(isinstance(e, BlockStored) and e.extra_keys for e in events)
    payload = encode_batch(events, ts=1234.5, data_parallel_rank=0, raw_hashes=raw)

    batch = DECODER.decode(payload)
    assert batch.ts == 1234.5 and batch.data_parallel_rank == 0
    expected = [as_vllm(e, raw) for e in events]
    assert batch.events == expected
    # What vLLM's msgspec encoder writes for the same batch, byte for byte.
    assert ENCODER.encode(Batch(ts=1234.5, events=expected, data_parallel_rank=0)) == payload


def test_layout_is_an_array_of_tagged_maps() -> None:
    events: list[KvEvent] = [
        BlockStored(block_hashes=[(5 << 64) | 7], parent_block_hash=None, token_ids=[1, 2], block_size=2),
        BlockRemoved(block_hashes=[(5 << 64) | 7]),
        AllBlocksCleared(),
    ]
    plain = msgspec.msgpack.decode(encode_batch(events, ts=2.0, data_parallel_rank=3))
    assert plain[0] == 2.0 and plain[2] == 3
    stored, removed, cleared = plain[1]
    assert list(stored) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ]  # no extra_keys when unset: vLLM omits defaults
    assert stored["type"] == "BlockStored" and stored["block_hashes"] == [7]  # the low 64 bits
    assert removed == {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"}
    assert cleared == {"type": "AllBlocksCleared"}


def test_optional_fields_and_defaults() -> None:
    stored = BlockStored(
        block_hashes=[1, 2],
        parent_block_hash=2**128 - 1,
        token_ids=[7, 8],
        block_size=1,
        lora_id=-3,
        medium=None,
        lora_name="adapter",
        extra_keys=[("mm", 4, 1.5, True, None, b"x"), None],
    )
    batch = DECODER.decode(encode_batch([stored], ts=0.0, data_parallel_rank=1))
    assert batch.events == [as_vllm(stored)]
    assert batch.events[0].parent_block_hash == LOW_64
    # No rank: written as nil (three elements, as Dynamo's decoder requires).
    plain = msgspec.msgpack.decode(encode_batch([], ts=0.0))
    assert plain == [0.0, [], None]
    # ts defaults to now.
    assert DECODER.decode(encode_batch([])).ts > 1.6e9


def test_engine_events_round_trip_exactly_with_take_events() -> None:
    kv = pagedkv.KvCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True, enable_kv_events=True)
    kv.add_sequence(1, list(range(10)))
    events = kv.take_events()
    decoded = DECODER.decode(encode_batch(events, ts=1.0, data_parallel_rank=0, raw_hashes=True))
    (stored,) = decoded.events
    assert [int.from_bytes(h, "big") for h in stored.block_hashes] == events[0].block_hashes
    assert stored.token_ids == list(range(8)) and stored.block_size == 4 and stored.medium == "GPU"


def hybrid_workload_events(seed: int) -> list[KvEvent]:
    """Stores and evictions of a hybrid manager (a full group and two window groups) whose pool
    is small enough that admissions evict cached blocks of every group."""
    rng = random.Random(seed)
    groups = [pagedkv.FullAttention(), pagedkv.SlidingWindow(window=4), pagedkv.SlidingWindow(window=9)]
    kv = pagedkv.KvCacheManager(
        num_blocks=30, block_size=4, enable_prefix_caching=True, enable_kv_events=True, kv_groups=groups
    )
    prefixes = [[rng.randrange(50_000) for _ in range(12)] for _ in range(4)]
    events: list[KvEvent] = []
    for seq in range(30):
        prompt = rng.choice(prefixes) + [rng.randrange(50_000) for _ in range(rng.randrange(0, 9))]
        try:
            kv.add_sequence(seq, prompt)
        except pagedkv.OutOfBlocksError:
            pass
        else:
            kv.free(seq)
        events.extend(kv.take_events())
    return events


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("raw", [False, True])
def test_hybrid_events_carry_their_group_as_vllm_group_idx(seed: int, raw: bool) -> None:
    """A hybrid manager stores and evicts the same hash once per group; each event carries its
    group in vLLM's ``group_idx`` (written, 0 included, after the other fields), which vLLM's
    structs decode, and msgspec encodes the same structs to the same bytes. Fails on the events
    without a group (every ``group_idx`` None, a router cannot tell the groups apart)."""
    events = hybrid_workload_events(seed)
    payload = encode_batch(events, ts=7.0, data_parallel_rank=0, raw_hashes=raw)
    batch = DECODER.decode(payload)
    expected = [as_vllm(e, raw) for e in events]
    assert batch.events == expected
    assert ENCODER.encode(Batch(ts=7.0, events=expected, data_parallel_rank=0)) == payload
    stored = [e for e in batch.events if isinstance(e, Stored)]
    removed = [e for e in batch.events if isinstance(e, Removed)]
    assert {e.group_idx for e in stored} == {0, 1, 2}
    assert {e.group_idx for e in removed} == {0, 1, 2}
    # The same first block is stored once per group, each under its own group.
    first = {
        e.group_idx
        for e in stored
        if e.parent_block_hash is None and e.block_hashes[0] == stored[0].block_hashes[0]
    }
    assert first == {0, 1, 2}
    # On the wire: group 0 is written (it is not vLLM's default, None), as the last key.
    plain = msgspec.msgpack.decode(payload)
    for event in plain[1]:
        assert list(event)[-1] == "group_idx"
    assert any(event["group_idx"] == 0 for event in plain[1])


def test_plain_manager_events_have_no_group_and_the_same_bytes() -> None:
    """The plain manager's events have ``group_idx`` None, omitted on the wire: the bytes of the
    schema without the field."""
    events = workload_events(0)
    assert all(e.group_idx is None for e in events if not isinstance(e, AllBlocksCleared))
    plain = msgspec.msgpack.decode(encode_batch(events, ts=1.0, data_parallel_rank=0))
    assert all("group_idx" not in event for event in plain[1])


class Index:
    """An id whose ``__index__`` raises ``error`` (the same object every time)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __index__(self) -> int:
        raise self.error


@pytest.mark.parametrize(
    ("events", "error", "match"),
    [
        ([object()], InvalidArgumentTypeError, r"events\[0\]"),
        ([AllBlocksCleared(), BlockRemoved(block_hashes=[-1])], InvalidArgumentError, r"events\[1\]"),
        ([BlockRemoved(block_hashes=[1 << 128])], InvalidArgumentError, r"events\[0\]"),
        ([BlockRemoved(block_hashes=["1"])], InvalidArgumentTypeError, r"events\[0\]: block_hashes"),  # type: ignore[list-item]
        (
            [
                BlockStored(
                    block_hashes=[1], parent_block_hash=None, token_ids=[1], block_size=1, extra_keys=[({},)]
                )
            ],
            InvalidArgumentTypeError,
            "extra_keys",
        ),
        (
            [BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[-1], block_size=1)],
            InvalidArgumentError,
            r"events\[0\]",
        ),
        ([BlockRemoved(block_hashes=[1], medium="GPU\ud800")], InvalidArgumentError, r"events\[0\]: medium"),
        (
            [
                BlockStored(
                    block_hashes=[1], parent_block_hash=None, token_ids=[1], block_size=1, lora_name="\udfff"
                )
            ],
            InvalidArgumentError,
            "lora_name",
        ),
        ([BlockRemoved(block_hashes=[Index(ValueError("bad id"))])], InvalidArgumentError, "bad id"),  # type: ignore[list-item]
        ([BlockRemoved(block_hashes=5)], InvalidArgumentTypeError, "block_hashes"),  # type: ignore[arg-type]
    ],
)
def test_bad_events_raise_typed_errors(events: list[KvEvent], error: type[Exception], match: str) -> None:
    """Every refusal is a pagedkv error; the wrong-type ones stay TypeErrors (as before)."""
    with pytest.raises(error, match=match) as caught:
        encode_batch(events, ts=0.0)
    assert isinstance(caught.value, pagedkv.PagedKvError)


@pytest.mark.parametrize(
    "make",
    [
        lambda bad: BlockRemoved(block_hashes=[1, bad]),
        lambda bad: BlockStored(block_hashes=[1], parent_block_hash=bad, token_ids=[1], block_size=1),
        lambda bad: BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1, bad], block_size=1),
        lambda bad: BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1], block_size=bad),
        lambda bad: BlockStored(
            block_hashes=[1], parent_block_hash=None, token_ids=[1], block_size=1, lora_id=bad
        ),
    ],
)
@pytest.mark.parametrize("error", [SystemExit(3), KeyboardInterrupt(), MemoryError()])
def test_exceptions_that_must_propagate_come_back_as_the_same_object(
    make: Callable[[object], KvEvent], error: BaseException
) -> None:
    """docs/security.md guarantee 5: SystemExit(3) raised in the caller's __index__ keeps exit
    status 3 (the bindings used to re-create it as SystemExit("events[0]: 3"), status 1)."""
    with pytest.raises(type(error)) as caught:
        encode_batch([AllBlocksCleared(), make(Index(error))], ts=0.0)
    assert caught.value is error
    if isinstance(error, SystemExit):
        assert caught.value.code == 3


def test_subclassed_fields_encode_as_their_builtin_values() -> None:
    """int / str / bytes / float subclasses and __index__ objects encode as the plain values."""

    class Id(int):
        pass

    class Name(str):
        def encode(self, *args: object, **kwargs: object) -> bytes:  # never consulted
            raise AssertionError("the encoder must not call a subclass's encode")

    class Ix:
        def __index__(self) -> int:
            return 7

    plain = BlockStored(
        block_hashes=[7],
        parent_block_hash=None,
        token_ids=[7, 7],
        block_size=7,
        medium="GPU",
        extra_keys=[(7, "GPU", b"k", 1.5, True, None)],
    )
    odd = BlockStored(
        block_hashes=[Id(7)],
        parent_block_hash=None,
        token_ids=(Ix(), Id(7)),
        block_size=Ix(),  # type: ignore[arg-type]
        medium=Name("GPU"),
        extra_keys=[(Id(7), Name("GPU"), b"k", 1.5, True, None)],
    )
    assert encode_batch([odd], ts=1.0) == encode_batch([plain], ts=1.0)


def test_bad_arguments() -> None:
    """Typed pagedkv errors, still TypeErrors where they were (encode_batch raised a
    bare TypeError)."""
    with pytest.raises(InvalidArgumentTypeError):
        encode_batch([], ts=0.0, data_parallel_rank=True)
    with pytest.raises(InvalidArgumentTypeError):
        encode_batch([], ts=0.0, data_parallel_rank="0")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="64 bits"):
        encode_batch([], ts=0.0, data_parallel_rank=1 << 63)
    with pytest.raises(InvalidArgumentTypeError):
        encode_batch(5)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentTypeError):
        encode_batch([], ts="now")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="ts"):
        encode_batch([], ts=10**400)

    def failing() -> Iterator[KvEvent]:
        yield AllBlocksCleared()
        raise ValueError("the caller's iterator broke")

    with pytest.raises(InvalidArgumentError, match="iterator broke"):
        encode_batch(failing())
