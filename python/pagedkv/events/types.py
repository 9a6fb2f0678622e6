"""The KV-event types ``KvCacheManager.take_events()`` returns (re-exported by ``pagedkv.events``,
whose docstring tells the story; the Rust bindings build and read them under that name).

Field names follow vLLM's KV-event schema (``vllm.distributed.kv_events``: ``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``). Block hashes are Python ``int``s (the core's 128-bit
keyed chained hashes; vLLM's ``ExternalBlockHash`` is ``bytes | int``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias

__all__ = ["MEDIUM_GPU", "BlockStored", "BlockRemoved", "AllBlocksCleared", "KvEvent"]

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
    ``group_idx`` is the KV-cache group of the blocks (vLLM's field): the group's index in a
    hybrid manager (``kv_groups``), ``None`` for the plain manager (omitted on the wire).
    """

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None

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
                self.group_idx,
            )
        )


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks whose content left the prefix index (evicted for reuse); ``group_idx`` as in
    ``BlockStored``."""

    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = None

    def __hash__(self) -> int:
        return hash((tuple(self.block_hashes), self.medium, self.group_idx))


@dataclass(frozen=True)
class AllBlocksCleared:
    """The prefix index was emptied (``reset_prefix_cache()``)."""


KvEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared
