"""The ``BlockStore`` protocol: what the allocator's lower tiers and the engine see of a store.

A store maps a key (a block's chained hash plus its salt, see ``keys.py``) to a payload (bytes
or a NumPy array). It is a cache, not a database: every operation may lose an entry (evicted,
expired, corrupted, the server restarted), and every failure of the medium is reported as a
miss (``get`` returns ``None``) or a failed put (``put`` returns ``False``), never raised into
the caller's step. Only caller mistakes raise: a wrong key or payload type
(``InvalidArgumentTypeError``), an out-of-range hash or an unknown dtype (``InvalidArgumentError``).

``kv_cache_dtype`` (every operation; None for an unquantized cache) is part of the key
(``keys.encode_key``): a block written by an int8 cache is never served to an fp8 or a 16-bit one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from pagedkv.offload.codec import Payload

__all__ = ["BlockStore", "StoreStats"]


@dataclass
class StoreStats:
    """Counters a store keeps since it was opened."""

    puts: int = 0
    failed_puts: int = 0
    hits: int = 0
    misses: int = 0
    corrupt_entries: int = 0
    evictions: int = 0
    errors: int = 0
    last_error: str | None = None


@runtime_checkable
class BlockStore(Protocol):
    """A bounded, lossy key-value store of KV blocks."""

    def put(
        self,
        block_hash: int | bytes,
        payload: Payload,
        *,
        extra_key: object = None,
        kv_cache_dtype: str | None = None,
    ) -> bool:
        """Store ``payload``; ``True`` if stored, ``False`` if the medium refused it."""
        ...

    def get(
        self, block_hash: int | bytes, *, extra_key: object = None, kv_cache_dtype: str | None = None
    ) -> Payload | None:
        """The stored payload, or ``None`` (a miss: absent, evicted, corrupt, unreachable)."""
        ...

    def contains(
        self, block_hash: int | bytes, *, extra_key: object = None, kv_cache_dtype: str | None = None
    ) -> bool:
        """Whether ``get`` would probably hit (an entry may still turn out corrupt)."""
        ...

    def contains_many(
        self,
        block_hashes: Iterable[int | bytes],
        *,
        extra_key: object = None,
        kv_cache_dtype: str | None = None,
    ) -> list[bool]:
        """``contains`` for each hash, in one round trip where the medium allows."""
        ...

    def delete(
        self, block_hash: int | bytes, *, extra_key: object = None, kv_cache_dtype: str | None = None
    ) -> bool:
        """Remove the entry; ``True`` if there was one."""
        ...

    @property
    def capacity_bytes(self) -> int | None:
        """The bound on stored bytes (``None``: bounded by the medium only)."""
        ...

    @property
    def usage_bytes(self) -> int:
        """Bytes stored now (entries with their headers)."""
        ...

    @property
    def stats(self) -> StoreStats:
        """The store's counters."""
        ...
