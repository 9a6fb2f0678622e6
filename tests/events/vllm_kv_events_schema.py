"""vLLM's KV-event wire schema, written out here as msgspec structs so the tests decode pagedkv's
bytes the way a vLLM subscriber does, without installing vLLM (its wheel is hundreds of MB).

Re-expressed from ``vllm/distributed/kv_events.py`` as of vLLM v0.26.0 (after
vllm-project/vllm#42892): the batch is a positional array (``array_like``), each event a map
tagged ``"type"`` with the class name, defaults omitted. Field names, order, types and defaults
are the contract; docs/events.md lists them.
"""

from __future__ import annotations

from typing import Any

import msgspec

# vLLM: ExternalBlockHash = bytes | int
BlockHashOnWire = bytes | int


class Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's ``EventBatch`` / ``KVEventBatch``: ``[ts, events, data_parallel_rank]``."""

    ts: float
    events: list[Stored | Removed | Cleared]
    data_parallel_rank: int | None = None


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag_field="type"):
    """vLLM's ``KVCacheEvent``: a map whose ``"type"`` is the subclass name."""


class Stored(_Event, tag="BlockStored"):
    block_hashes: list[BlockHashOnWire]
    parent_block_hash: BlockHashOnWire | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class Removed(_Event, tag="BlockRemoved"):
    block_hashes: list[BlockHashOnWire]
    medium: str | None
    group_idx: int | None = None


class Cleared(_Event, tag="AllBlocksCleared"):
    pass


DECODER = msgspec.msgpack.Decoder(Batch)
ENCODER = msgspec.msgpack.Encoder()
