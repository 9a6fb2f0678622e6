"""Offload stores: where KV blocks evicted from the device pool are kept, keyed by their
chained hash and salt, and loaded back as prefix hits (``docs/offload.md``).

- ``BlockStore``: the protocol every store follows (``store.py``).
- ``DiskStore``: one checksummed file per block in a local directory, LRU-bounded by bytes.
- ``RedisStore``: the same entries in a Redis server shared by replicas (needs ``redis-py``,
  the ``offload`` extra).
- ``OffloadWorker``: a background thread that runs store I/O off the step, with deadlines.
"""

from __future__ import annotations

from pagedkv.offload.codec import Payload
from pagedkv.offload.disk import DiskStore
from pagedkv.offload.keys import encode_key
from pagedkv.offload.redis_store import RedisStore
from pagedkv.offload.store import BlockStore, StoreStats
from pagedkv.offload.worker import OffloadWorker

__all__ = [
    "BlockStore",
    "DiskStore",
    "OffloadWorker",
    "Payload",
    "RedisStore",
    "StoreStats",
    "encode_key",
]
