"""vLLM's ``evict_blocks``: drops chosen blocks from the prefix cache by id.

vLLM's scheduler calls it when a KV connector reports blocks whose synchronous load failed,
under ``kv_load_failure_policy="fail"`` (the failed load's first invalid block and every block
after it in each affected request): their content must never be a hit again. The core's
``evict_blocks`` answers it exactly as vLLM's block pool does: each block that has an index
entry loses it, with one ``BlockRemoved``; a block requests still hold stays in their tables as
a private block (vLLM's block keeps its ``ref_cnt`` and loses its hash), a cached-evictable one
becomes a free block; a block without an entry (free, the null block, one named twice) is left
alone. The ids are taken in the iteration order of the caller's set, so the events come in
vLLM's order.

One difference on hostile input: vLLM asserts that an id is below its pool (an
``AssertionError``) and would read a negative id from the end of its block list; pagedkv raises
``InvalidArgumentError`` for both, changing nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def evict_blocks(manager: Any, block_ids: Iterable[int]) -> None:
    """Drops ``block_ids``' prefix-cache entries (see the module docstring); their removal
    events join the manager's event queue (the manager is typed ``Any``: no import cycle)."""
    manager._core.evict_blocks(list(block_ids))
    manager._collect_events(None)
