"""What a KV-cache-aware router knows of one replica: an index built from its KV events only.

The router never sees the engines' hash function. Like Dynamo's KV router, it keys each stored
block by its own chain of block digests (parent key, digest of the block's token ids, which the
events carry), remembers which engine hash names which key so that ``BlockRemoved`` (engine
hashes only) can drop it, and keys a new request's prompt the same way; a request's match on a
replica is the number of its leading blocks the replica has announced and not yet removed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from pagedkv._core import token_block_digests
from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored

__all__ = ["EventDigest", "EventIndex", "event_digests", "chain_key", "request_keys"]

EventDigest = tuple[str, list[int], "int | None", list[int]]
"""``KvCacheManager.take_event_digests()``'s form of one event: (kind, block_hashes,
parent_block_hash, block_digests)."""


class EventIndex:
    """What a router knows of one replica's prefix cache, built from its KV events only.

    Like Dynamo's radix tree, it keys a stored block by the router's own chain of block digests
    (parent key, digest of the block's tokens) and remembers which engine hash names which key,
    so that ``BlockRemoved`` (engine hashes only) can drop it. The digests come from the events'
    ``token_ids`` (``take_event_digests`` folds them in Rust; ``apply_events`` does it for event
    objects): the index learns nothing the event stream does not say."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._keys: set[int] = set()
        self._key_of_hash: dict[int, int] = {}

    def apply(self, events: Iterable[EventDigest]) -> list[int]:
        """Applies events in ``take_event_digests()`` form, oldest first; returns the keys
        ``BlockRemoved`` dropped (what a shared tier receives, `pagedkv.sim.shared_tier`)."""
        keys, key_of_hash = self._keys, self._key_of_hash
        removed: list[int] = []
        for kind, block_hashes, parent_hash, digests in events:
            if kind == "BlockStored":
                parent = 0 if parent_hash is None else key_of_hash.get(parent_hash)
                if parent is None:  # a parent the router never saw (a missed event): skip
                    continue
                for engine_hash, digest in zip(block_hashes, digests, strict=True):
                    parent = chain_key(parent, digest)
                    keys.add(parent)
                    key_of_hash[engine_hash] = parent
            elif kind == "BlockRemoved":
                for engine_hash in block_hashes:
                    key = key_of_hash.pop(engine_hash, None)
                    if key is not None:
                        keys.discard(key)
                        removed.append(key)
            elif kind == "AllBlocksCleared":
                keys.clear()
                key_of_hash.clear()
        return removed

    def apply_events(self, events: Iterable[Any]) -> list[int]:
        """Applies ``take_events()`` objects (digesting each stored block's ``token_ids``);
        returns the keys ``BlockRemoved`` dropped, as ``apply`` does."""
        return self.apply(event_digests(events))

    def match(self, keys: Sequence[int]) -> int:
        """Leading blocks of a request (its chained keys) this replica has announced."""
        matched = 0
        for key in keys:
            if key not in self._keys:
                break
            matched += 1
        return matched

    def __len__(self) -> int:
        return len(self._keys)


def event_digests(events: Iterable[Any]) -> list[EventDigest]:
    """``take_events()`` objects in ``take_event_digests()`` form."""
    out: list[EventDigest] = []
    for event in events:
        if isinstance(event, BlockStored):
            extra = event.extra_keys[0] if event.extra_keys else None
            digests = token_block_digests(
                np.asarray(event.token_ids, dtype=np.uint32),
                event.block_size,
                extra_key=None if extra is None else extra[0],
            )
            out.append(("BlockStored", list(event.block_hashes), event.parent_block_hash, digests.tolist()))
        elif isinstance(event, BlockRemoved):
            out.append(("BlockRemoved", list(event.block_hashes), None, []))
        elif isinstance(event, AllBlocksCleared):
            out.append(("AllBlocksCleared", [], None, []))
    return out


def chain_key(parent: int, digest: int) -> int:
    """The router's own chained block key: (parent key, digest of the block's token ids)."""
    return hash((parent, digest))


def request_keys(tokens: np.ndarray, block_size: int) -> list[int]:
    """A request's chained block keys, one per full block, as the router computes them."""
    keys, parent = [], 0
    for digest in token_block_digests(tokens, block_size).tolist():
        parent = chain_key(parent, digest)
        keys.append(parent)
    return keys
