"""The ``KVCacheBlocks`` pagedkv's vLLM manager returns: vLLM's own class, whose
``get_block_ids`` answers the scheduler's per-request read without a generator.

vLLM's scheduler reads every scheduled running request's new blocks once a step
(``_make_cached_request_data``: ``get_block_ids(allow_none=True)``), and on most decode steps
those are the manager's shared empty ``KVCacheBlocks``. vLLM's method builds a generator over
the groups for the empty test (``all(len(group) == 0 ...)``) and a comprehension per group for
the ids; here ``any(groups)`` is the same test (a group is a sequence: empty exactly when
falsy) and ``map`` over ``block_id`` the same ids, in C; the shared empty one's class answers
that read (None) without looking at its groups. The answers are vLLM's, value for value
(tests/vllm/test_vllm_kv_blocks.py compares them); a group selection (``group_ids``), which the
scheduler makes for KV connectors only, is vLLM's own method.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

from vllm.v1.core.kv_cache_manager import KVCacheBlocks

_block_id = attrgetter("block_id")


class PagedkvKVCacheBlocks(KVCacheBlocks):
    """vLLM's ``KVCacheBlocks`` (same field, same methods and answers, ``isinstance`` of it),
    with a faster ``get_block_ids``; equal to a ``KVCacheBlocks`` holding the same blocks."""

    def get_block_ids(
        self, allow_none: bool = False, *, group_ids: Sequence[int] | None = None
    ) -> tuple[list[int], ...] | None:
        if group_ids is not None:
            return KVCacheBlocks.get_block_ids(self, allow_none, group_ids=group_ids)
        groups = self.blocks
        if allow_none and not any(groups):
            return None
        if len(groups) == 1:  # the common case, without the generator
            return (list(map(_block_id, groups[0])),)
        return tuple(list(map(_block_id, group)) for group in groups)

    # The dataclass's own equality holds for two objects of one class only: equal to vLLM's
    # class too (a subclass's __eq__ is tried first from either side), unhashable as it is.
    def __eq__(self, other: object) -> bool:
        if isinstance(other, KVCacheBlocks):
            return self.blocks == other.blocks
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"KVCacheBlocks(blocks={self.blocks!r})"


class _EmptyKVCacheBlocks(PagedkvKVCacheBlocks):
    """The shared empty answer (``empty_blocks``): its groups are empty tuples, which never
    fill, so the scheduler's read (``allow_none=True``, every group) is None without looking."""

    def get_block_ids(
        self, allow_none: bool = False, *, group_ids: Sequence[int] | None = None
    ) -> tuple[list[int], ...] | None:
        if allow_none and group_ids is None:
            return None
        return PagedkvKVCacheBlocks.get_block_ids(self, allow_none, group_ids=group_ids)


def empty_blocks(num_groups: int) -> PagedkvKVCacheBlocks:
    """The shared empty answer: no block in any of ``num_groups`` groups."""
    return _EmptyKVCacheBlocks(tuple(() for _ in range(num_groups)))
