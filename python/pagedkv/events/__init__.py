"""KV-cache events (``KvCacheManager.take_events()``), recorded only by a manager built with
``enable_prefix_caching=True, enable_kv_events=True`` (events are off by default, as in vLLM).

Field names follow vLLM's KV-event schema (``vllm.distributed.kv_events``: ``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``) so that KV-aware routers written against vLLM can consume
them unchanged. Block hashes are Python ``int``s (the core's 128-bit keyed chained hashes; vLLM's
``ExternalBlockHash`` is ``bytes | int``).

``encode_batch`` turns a list of them into the bytes vLLM publishes over ZMQ (one ``EventBatch``,
docs/events.md); ``ZmqEventPublisher`` (extra ``events``: pyzmq) publishes them as vLLM does.
This package's ``__init__`` is the public face: the types live in ``pagedkv.events.types``, the
encoder in ``pagedkv.events.wire`` and the publisher in ``pagedkv.events.zmq_publisher`` (which
imports the encoder module, never this package: no import cycle).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedkv.errors import InvalidArgumentTypeError
from pagedkv.events.types import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from pagedkv.events.wire import encode_batch

if TYPE_CHECKING:  # pyzmq is the optional extra `events`; the publisher imports it lazily
    from pagedkv.events.zmq_publisher import ZmqEventPublisher

__all__ = [
    "MEDIUM_GPU",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "KvEvent",
    "InvalidArgumentTypeError",
    "encode_batch",
    "ZmqEventPublisher",
]


def __getattr__(name: str) -> Any:
    # The publisher needs pyzmq (extra `events`); importing pagedkv.events must not.
    if name == "ZmqEventPublisher":
        from pagedkv.events.zmq_publisher import ZmqEventPublisher

        return ZmqEventPublisher
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
