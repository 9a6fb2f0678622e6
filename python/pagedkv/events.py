"""KV-cache events (``KvCacheManager.take_events()``), recorded only by a manager built with
``enable_prefix_caching=True, enable_kv_events=True`` (events are off by default, as in vLLM).

Field names follow vLLM's KV-event schema (``vllm.distributed.kv_events``: ``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``) so that KV-aware routers written against vLLM can consume
them unchanged. Block hashes are Python ``int``s (the core's 128-bit keyed chained hashes; vLLM's
``ExternalBlockHash`` is ``bytes | int``).

``encode_batch`` turns a list of them into the bytes vLLM publishes over ZMQ (one ``EventBatch``,
docs/events.md); ``ZmqEventPublisher`` (extra ``events``: pyzmq) publishes them as vLLM does.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:  # pyzmq is the optional extra `events`; the publisher imports it lazily
    from pagedkv.zmq_publisher import ZmqEventPublisher

__all__ = [
    "MEDIUM_GPU",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "KvEvent",
    "encode_batch",
    "ZmqEventPublisher",
]

MEDIUM_GPU = "GPU"
"""The medium of device-tier blocks, as vLLM names it."""


@dataclass(frozen=True)
class BlockStored:
    """Full blocks entered into the prefix index, in chain order.

    ``block_hashes[i]`` is the hash of the i-th stored block; ``parent_block_hash`` is the hash of
    the block before ``block_hashes[0]`` in its chain (``None`` at the start of a prompt).
    ``token_ids`` holds ``len(block_hashes) * block_size`` ids, the stored blocks' tokens in order.
    ``extra_keys`` has one entry per block: ``(extra_key,)`` when the request carried an
    ``extra_key`` (as bytes), else ``None``; the whole field is ``None`` when no block had one.
    """

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None

    def __hash__(self) -> int:
        return hash(
            (
                tuple(self.block_hashes),
                self.parent_block_hash,
                tuple(self.token_ids),
                self.block_size,
                self.lora_id,
                self.medium,
                self.lora_name,
                tuple(self.extra_keys) if self.extra_keys else None,
            )
        )


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks whose content left the prefix index (evicted for reuse)."""

    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU

    def __hash__(self) -> int:
        return hash((tuple(self.block_hashes), self.medium))


@dataclass(frozen=True)
class AllBlocksCleared:
    """The prefix index was emptied (``reset_prefix_cache()``)."""


KvEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


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
    Raises TypeError / OverflowError (naming the event's index) for anything that is not a
    ``pagedkv.events`` object with fields of the schema's types.
    """
    from pagedkv import _core

    stamp = time.time() if ts is None else float(ts)
    if data_parallel_rank is not None and (
        isinstance(data_parallel_rank, bool) or not isinstance(data_parallel_rank, int)
    ):
        raise TypeError(f"data_parallel_rank must be an int or None, not {type(data_parallel_rank).__name__}")
    return _core.encode_event_batch(list(events), stamp, data_parallel_rank, bool(raw_hashes))


def __getattr__(name: str) -> Any:
    # The publisher needs pyzmq (extra `events`); importing pagedkv.events must not.
    if name == "ZmqEventPublisher":
        from pagedkv.zmq_publisher import ZmqEventPublisher

        return ZmqEventPublisher
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
