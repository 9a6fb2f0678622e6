"""``RedisStore``: KV blocks in a Redis server shared by every replica.

Values are the same self-checking entries as on disk (``codec.py``): a value cut short, flipped
or written by something else under our key is a miss, and is deleted. Keys are
``namespace + b":" + key`` (``keys.py``: hash and salt), so two deployments sharing a server
use two namespaces and two tenants never share a key. Eviction is the server's: run it with
``maxmemory`` and ``maxmemory-policy allkeys-lru`` (``capacity_bytes`` reports ``maxmemory``),
and/or give entries a TTL (``ttl_s``).

Every server failure (refused connection, a timeout, a restart that lost the data) is a miss
or a failed put, counted in ``stats``; ``redis-py`` reconnects on the next call, so a restarted
server serves again without the caller doing anything. Socket timeouts are short by default
(``timeout_s``): a load that waits longer than that is better recomputed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from pagedkv.errors import InvalidArgumentError, InvalidArgumentTypeError
from pagedkv.offload.codec import Payload, decode_entry, encode_entry, entry_size
from pagedkv.offload.keys import encode_key
from pagedkv.offload.store import StoreStats

__all__ = ["RedisStore"]


def _redis_module() -> Any:
    try:
        import redis
    except ImportError as exc:  # an optional extra
        raise ImportError("RedisStore needs redis-py: pip install 'pagedkv[offload]'") from exc
    return redis


def _check_seconds(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentTypeError(f"{name} is a number of seconds, not {type(value).__name__}")
    if not (value > 0 and math.isfinite(value)):
        raise InvalidArgumentError(f"{name} is a positive, finite number of seconds: {value!r}")


class RedisStore:
    """A ``BlockStore`` on the Redis server at ``url`` (``redis://host:port/db``)."""

    def __init__(
        self,
        url: str,
        *,
        namespace: str | bytes = "pagedkv",
        ttl_s: float | None = None,
        timeout_s: float = 1.0,
    ):
        if not isinstance(url, str):
            raise InvalidArgumentTypeError(f"url is a str, not {type(url).__name__}")
        if isinstance(namespace, str):
            namespace = namespace.encode("utf-8")
        if not isinstance(namespace, bytes) or not namespace:
            raise InvalidArgumentError("namespace is a non-empty str or bytes")
        if ttl_s is not None:
            _check_seconds("ttl_s", ttl_s)
        _check_seconds("timeout_s", timeout_s)
        redis = _redis_module()
        self._errors: tuple[type[BaseException], ...] = (redis.exceptions.RedisError, OSError)
        try:
            self._client = redis.Redis.from_url(
                url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
            )
        except ValueError as exc:
            raise InvalidArgumentError(f"not a Redis URL: {url!r} ({exc})") from exc
        self._url = url
        self._prefix = namespace + b":"
        self._ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self._stats = StoreStats()
        self._usage = 0

    def _key(
        self, block_hash: int | bytes, extra_key: object, kv_cache_dtype: object = None
    ) -> tuple[bytes, bytes]:
        key = encode_key(block_hash, extra_key, kv_cache_dtype)
        return key, self._prefix + key

    def _error(self, what: str, exc: BaseException) -> None:
        self._stats.errors += 1
        self._stats.last_error = f"{what} failed: {exc!r}"

    # -- the protocol --------------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int | None:
        """The server's ``maxmemory`` (``None``: unbounded, or the server is unreachable)."""
        try:
            value = int(self._client.config_get("maxmemory").get("maxmemory", 0))
        except self._errors as exc:
            self._error("config_get", exc)
            return None
        return value or None

    @property
    def usage_bytes(self) -> int:
        """Bytes this client has put (the server may have evicted or expired some since)."""
        return self._usage

    @property
    def stats(self) -> StoreStats:
        return self._stats

    def put(
        self,
        block_hash: int | bytes,
        payload: Payload,
        *,
        extra_key: object = None,
        kv_cache_dtype: str | None = None,
    ) -> bool:
        key, redis_key = self._key(block_hash, extra_key, kv_cache_dtype)
        parts = encode_entry(key, payload)
        value = b"".join(parts)
        try:
            self._client.set(redis_key, value, px=self._ttl_ms)
        except self._errors as exc:
            self._stats.failed_puts += 1
            self._error("put", exc)
            return False
        self._stats.puts += 1
        self._usage += entry_size(parts)
        return True

    def get(
        self, block_hash: int | bytes, *, extra_key: object = None, kv_cache_dtype: str | None = None
    ) -> Payload | None:
        key, redis_key = self._key(block_hash, extra_key, kv_cache_dtype)
        try:
            value = self._client.get(redis_key)
        except self._errors as exc:
            self._stats.misses += 1
            self._error("get", exc)
            return None
        if value is None:
            self._stats.misses += 1
            return None
        payload = decode_entry(value if isinstance(value, bytes) else b"", key)
        if payload is None:
            self._stats.corrupt_entries += 1
            self._stats.misses += 1
            self._delete_key(redis_key)
            return None
        self._stats.hits += 1
        return payload

    def contains(
        self, block_hash: int | bytes, *, extra_key: object = None, kv_cache_dtype: str | None = None
    ) -> bool:
        return self.contains_many([block_hash], extra_key=extra_key, kv_cache_dtype=kv_cache_dtype)[0]

    def contains_many(
        self,
        block_hashes: Iterable[int | bytes],
        *,
        extra_key: object = None,
        kv_cache_dtype: str | None = None,
    ) -> list[bool]:
        redis_keys = [self._key(h, extra_key, kv_cache_dtype)[1] for h in block_hashes]
        if not redis_keys:
            return []
        try:
            pipe = self._client.pipeline(transaction=False)
            for redis_key in redis_keys:
                pipe.exists(redis_key)
            return [bool(found) for found in pipe.execute()]
        except self._errors as exc:
            self._error("contains", exc)
            return [False] * len(redis_keys)

    def delete(
        self, block_hash: int | bytes, *, extra_key: object = None, kv_cache_dtype: str | None = None
    ) -> bool:
        return self._delete_key(self._key(block_hash, extra_key, kv_cache_dtype)[1])

    def _delete_key(self, redis_key: bytes) -> bool:
        try:
            return bool(self._client.delete(redis_key))
        except self._errors as exc:
            self._error("delete", exc)
            return False

    def close(self) -> None:
        """Close the connection pool (a later call reconnects)."""
        try:
            self._client.close()
        except self._errors as exc:
            self._error("close", exc)

    def __repr__(self) -> str:
        return f"RedisStore({self._url!r}, namespace={self._prefix[:-1]!r})"
