"""``encode_batch``: a list of KV events -> the bytes vLLM publishes over ZMQ (one ``EventBatch``,
docs/events.md). Re-exported by ``pagedkv.events``; ``pagedkv.events.zmq_publisher`` encodes with it.

The encoder itself is the Rust core's (``pagedkv._core.encode_event_batch``); this module reads the
caller's events into builtin values first, so that none of the caller's code runs inside it.
"""

from __future__ import annotations

import numbers
import operator
import time
from collections.abc import Collection, Iterable
from typing import Any

from pagedkv.errors import InvalidArgumentError, InvalidArgumentTypeError, PagedKvError
from pagedkv.events.types import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

__all__ = ["encode_batch"]


def encode_batch(
    events: Iterable[KvEvent],
    ts: float | None = None,
    data_parallel_rank: int | None = None,
    *,
    raw_hashes: bool = False,
) -> bytes:
    """Encodes ``events`` as one vLLM ``EventBatch``: the msgpack array
    ``[ts, events, data_parallel_rank]`` whose events are maps tagged ``"type"``
    (docs/events.md has the byte-level contract and the vLLM version it follows).

    ``ts`` defaults to ``time.time()``; a ``data_parallel_rank`` of None is written as nil.
    Block hashes go out as unsigned 64-bit ints, the low 64 bits of pagedkv's 128-bit hashes
    (vLLM's default), or with ``raw_hashes=True`` as the 16 big-endian bytes of the whole hash.

    Raises ``InvalidArgumentTypeError`` (an ``InvalidArgumentError`` that is also a
    ``TypeError``) for anything that is not a ``pagedkv.events`` object with fields of the
    schema's types, and ``InvalidArgumentError`` for a value out of the schema's range (a negative
    or too large id, a string that is not valid UTF-8), each naming the event's index. An
    exception that is not an ``Exception`` (``SystemExit``, ``KeyboardInterrupt``) or a
    ``MemoryError`` raised by the caller's own ``__index__`` propagates unchanged.
    """
    stamp = _timestamp(ts)
    rank = _rank(data_parallel_rank)
    raw = _flag("raw_hashes", raw_hashes)
    plain = _plain_events(events)
    # Imported here, not at the top: `import pagedkv` (which imports the event types through this
    # package) must not load the extension (see docs/design.md on loading the extension on first use).
    from pagedkv import _core

    try:
        # Every field is now a builtin value: no caller code runs inside the encoder, so what it
        # can still refuse is a value out of the wire's range (a negative or > 64-bit integer).
        return _core.encode_event_batch(plain, stamp, rank, raw)
    except PagedKvError:
        raise
    except TypeError as error:
        raise InvalidArgumentTypeError(str(error)) from None
    except (ValueError, OverflowError) as error:
        raise InvalidArgumentError(str(error)) from None


# -- checking and normalising the caller's events ----------------------------------------------------
# The encoder (Rust) reads each field by attribute; a field whose `__index__` (or `__iter__`,
# `__float__`) is the caller's code would run inside it, and the bindings re-create such an error
# with a prefixed message, turning `SystemExit(3)` into `SystemExit("events[0]: 3")` (exit status 1)
# and a `UnicodeEncodeError` into an unrelated TypeError. So every field is read here first, in
# Python, into builtin values: the caller's exceptions that must propagate do so as the same object,
# every other failure becomes a typed pagedkv error naming the event.


def _refuse(where: str, error: Exception) -> PagedKvError:
    """The typed error for a field the caller's code could not turn into a builtin value."""
    if isinstance(error, PagedKvError):
        return error
    if isinstance(error, TypeError):
        return InvalidArgumentTypeError(f"{where}: {error}")
    return InvalidArgumentError(f"{where}: {error}")


def _opt_int(value: Any) -> int | None:
    return None if value is None else operator.index(value)  # an exact int (Python >= 3.10)


def _ints(value: Any) -> list[int]:
    if type(value) is not list and (
        isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Collection)
    ):
        raise InvalidArgumentTypeError(f"expected a list of ints, not {type(value).__name__}")
    return list(map(operator.index, value))  # no Python frame per id


def _opt_str(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidArgumentTypeError(f"expected a str or None, not {type(value).__name__}")
    try:
        encoded = str.encode(value, "utf-8")  # the unbound method: a str subclass cannot hook it
    except UnicodeEncodeError as error:
        raise InvalidArgumentError(f"not valid UTF-8 ({error.reason} at index {error.start})") from None
    return value if type(value) is str else encoded.decode("utf-8")


def _extra_item(item: Any) -> Any:
    """One ``extra_keys`` item as the exact builtin the wire format has (bool before int)."""
    if item is None or type(item) is bool:
        return item
    if isinstance(item, int):
        return operator.index(item)  # an exact int, also for an int subclass
    if isinstance(item, float):
        return float.__float__(item)
    if isinstance(item, str):
        return _opt_str(item)
    if isinstance(item, bytes):
        return item if type(item) is bytes else bytes(memoryview(item))
    raise InvalidArgumentTypeError(
        f"an extra_keys item must be None, bool, int, float, str or bytes, not {type(item).__name__}"
    )


def _extra_keys(value: Any) -> list[tuple[Any, ...] | None] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Collection):
        raise InvalidArgumentTypeError(f"extra_keys must be a list or None, not {type(value).__name__}")
    keys: list[tuple[Any, ...] | None] = []
    for block in value:
        if block is not None and not isinstance(block, tuple):
            raise InvalidArgumentTypeError(
                f"an extra_keys entry must be a tuple or None, not {type(block).__name__}"
            )
        keys.append(None if block is None else tuple(_extra_item(item) for item in block))
    return keys


def _plain_event(event: Any) -> KvEvent:
    """``event`` rebuilt from builtin values (``AllBlocksCleared`` has no fields: itself). A failure
    (other than one that must propagate) names the field: ``field`` tracks the one being read."""
    field = ""
    try:
        if isinstance(event, BlockStored):
            field = "block_hashes"
            block_hashes = _ints(event.block_hashes)
            field = "parent_block_hash"
            parent = _opt_int(event.parent_block_hash)
            field = "token_ids"
            token_ids = _ints(event.token_ids)
            field = "block_size"
            block_size = operator.index(event.block_size)
            field = "lora_id"
            lora_id = _opt_int(event.lora_id)
            field = "medium"
            medium = _opt_str(event.medium)
            field = "lora_name"
            lora_name = _opt_str(event.lora_name)
            field = "extra_keys"
            extra_keys = _extra_keys(event.extra_keys)
            field = "group_idx"
            group_idx = _opt_int(event.group_idx)
            return BlockStored(
                block_hashes,
                parent,
                token_ids,
                block_size,
                lora_id,
                medium,
                lora_name,
                extra_keys,
                group_idx,
            )
        if isinstance(event, BlockRemoved):
            field = "block_hashes"
            block_hashes = _ints(event.block_hashes)
            field = "medium"
            medium = _opt_str(event.medium)
            field = "group_idx"
            return BlockRemoved(block_hashes, medium, _opt_int(event.group_idx))
    except MemoryError:
        raise
    except TypeError as error:
        raise InvalidArgumentTypeError(f"{field}: {error}") from error
    except Exception as error:
        raise InvalidArgumentError(f"{field}: {error}") from error
    if isinstance(event, AllBlocksCleared):
        return event
    raise InvalidArgumentTypeError(
        f"is a {type(event).__name__}, not a pagedkv.events BlockStored / BlockRemoved / AllBlocksCleared"
    )


def _plain_events(events: Any) -> list[KvEvent]:
    if isinstance(events, (str, bytes, bytearray)):
        raise InvalidArgumentTypeError(
            f"events: events must be an iterable of events, not {type(events).__name__}"
        )
    try:
        items = list(events)
    except MemoryError:
        raise
    except Exception as error:  # not iterable, or the caller's iterator failed
        raise _refuse("events", error) from error
    plain = []
    for index, event in enumerate(items):
        try:
            plain.append(_plain_event(event))
        except MemoryError:
            raise
        except InvalidArgumentError as error:  # _plain_event's own, naming the field: add the index
            raise type(error)(f"events[{index}]: {error}") from error
        except Exception as error:
            raise _refuse(f"events[{index}]", error) from error
    return plain


def _timestamp(ts: Any) -> float:
    if ts is None:
        return time.time()
    if isinstance(ts, bool) or not isinstance(ts, numbers.Real):
        raise InvalidArgumentTypeError(f"ts must be a real number (seconds), not {type(ts).__name__}")
    try:
        return float(ts)
    except MemoryError:
        raise
    except Exception as error:
        raise _refuse("ts", error) from error


def _rank(rank: Any) -> int | None:
    if rank is None:
        return None
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise InvalidArgumentTypeError(
            f"data_parallel_rank must be an int or None, not {type(rank).__name__}"
        )
    if not -(1 << 63) <= rank < 1 << 63:
        raise InvalidArgumentError(f"data_parallel_rank {rank} does not fit 64 bits")
    return int(rank)


def _flag(name: str, value: Any) -> bool:
    try:
        return bool(value)
    except MemoryError:
        raise
    except Exception as error:
        raise _refuse(name, error) from error
