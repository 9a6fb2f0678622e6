"""pagedkv's KV-cache events as vLLM's own event objects, keyed by vLLM's block hashes.

The manager gives the core each request's own block hashes (vLLM's ``request.block_hashes``,
bytes); the core keys blocks and events by their first 16 bytes (``pagedkv.reduce_block_hash``).
This translator remembers the bytes behind each reduced hash it was shown and writes vLLM's
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` with vLLM's hash values
(``maybe_convert_block_hash`` of the bytes), so a router fed by either manager sees the same keys.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

import pagedkv


class EventTranslator:
    """Drains the core's events as vLLM's; ``remember`` the bytes of hashes given to the core."""

    def __init__(self, core: Any, block_size: int) -> None:
        self._core = core
        self._block_size = block_size
        self._bytes: dict[int, bytes] = {}
        # Extra event fields per reduced hash: (lora_id, lora_name), from the request that
        # stored the block.
        self._lora: dict[int, tuple[int | None, str | None]] = {}

    def remember(self, hashes: Iterable[bytes], lora: tuple[int | None, str | None]) -> None:
        """Records the bytes behind each of ``hashes`` (a request's block hashes)."""
        reduce = pagedkv.reduce_block_hash
        for h in hashes:
            key = reduce(h)
            self._bytes[key] = h
            if lora != (None, None):
                self._lora[key] = lora

    def _vllm_hash(self, key: int) -> Any:
        raw = self._bytes.get(key)
        return key if raw is None else maybe_convert_block_hash(raw)

    def take(self) -> list[Any]:
        """The core's events since the last call, as vLLM's event objects."""
        out: list[Any] = []
        for event in self._core.take_events():
            if isinstance(event, pagedkv.BlockStored):
                first = event.block_hashes[0] if event.block_hashes else None
                lora_id, lora_name = (
                    self._lora.get(first, (None, None)) if first is not None else (None, None)
                )
                out.append(
                    BlockStored(
                        block_hashes=[self._vllm_hash(h) for h in event.block_hashes],
                        parent_block_hash=None
                        if event.parent_block_hash is None
                        else self._vllm_hash(event.parent_block_hash),
                        token_ids=list(event.token_ids),
                        block_size=event.block_size,
                        lora_id=lora_id,
                        medium=event.medium,
                        lora_name=lora_name,
                        extra_keys=None,
                        group_idx=event.group_idx,
                    )
                )
            elif isinstance(event, pagedkv.BlockRemoved):
                out.append(
                    BlockRemoved(
                        block_hashes=[self._vllm_hash(h) for h in event.block_hashes],
                        medium=event.medium,
                        group_idx=event.group_idx,
                    )
                )
            else:
                out.append(AllBlocksCleared())
        return out
