"""``RedisStore``: KV blocks in a Redis server shared by every replica.

Values are the same self-checking entries as on disk (``codec.py``): a value cut short, flipped
or written by something else under our key is a miss, and is deleted. Keys are
``namespace + b":" + key`` (``keys.py``: hash and salt), so two deployments sharing a server
use two namespaces and two tenants never share a key. Eviction is the server's: run it with
``maxmemory`` and ``maxmemory-policy allkeys-lru`` (``capacity_bytes`` reports ``maxmemory``),
and/or give entries a TTL (``ttl_s``).

Every server failure (refused connection, a timeout, a restart that lost the data) is a miss
or a failed put, counted in ``stats``; ``redis-py`` reconnects on the next call, so a restarted
server serves again without the caller doing anything. So is anything else a client call raises
(``Exception``: a client that fails in a way redis-py does not wrap costs hits, never a step).
Socket timeouts are short by default (``timeout_s``): a load that waits longer than that is
better recomputed.

The URL is checked when the store is made (``_check_url``): a scheme redis-py takes, a host
``getaddrinfo`` can look up, a numeric db, and no query option but ``db``. Before, redis-py
accepted ``?foo=bar`` or a 100,000-character host and every later call raised a bare
``TypeError`` / ``UnicodeError``, and ``?socket_timeout=`` silently replaced ``timeout_s``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from pagedkv.errors import InvalidArgumentError, InvalidArgumentTypeError
from pagedkv.offload.codec import Payload, decode_entry, encode_entry, entry_size
from pagedkv.offload.keys import encode_key
from pagedkv.offload.seconds import seconds
from pagedkv.offload.store import StoreStats

__all__ = ["MAX_URL_CHARS", "RedisStore"]

MAX_URL_CHARS = 4096
"""The longest URL taken: a host name has at most 253 characters, a Unix socket path 107."""

_MAX_HOST_CHARS = 253
_URL_OPTIONS = frozenset({"db"})
"""The only query option taken (also spelled as the path, ``/N``). Every other option redis-py
would hand its connection unchecked (``?foo=bar`` was a ``TypeError`` on every call) or let
override this store's own settings (``?socket_timeout=60`` over ``timeout_s``)."""


def _redis_module() -> Any:
    try:
        import redis
    except ImportError as exc:  # an optional extra
        raise ImportError("RedisStore needs redis-py: pip install 'pagedkv[offload]'") from exc
    return redis


def _url_error(url: str, why: str) -> InvalidArgumentError:
    shown = url if len(url) <= 200 else url[:200] + "..."
    return InvalidArgumentError(f"not a RedisStore URL: {shown!r} ({why})")


def _check_url(url: object) -> str:
    """``url`` if it is a Redis URL this store can use as it is, else a typed error: the
    problems redis-py would raise on every later call (a bare ``TypeError``, ``ValueError`` or
    ``UnicodeError`` caught nowhere) are found here, once."""
    if not isinstance(url, str):
        raise InvalidArgumentTypeError(f"url is a str, not {type(url).__name__}")
    if len(url) > MAX_URL_CHARS:
        raise _url_error(url, f"longer than {MAX_URL_CHARS} characters")
    if not url.isascii() or not url.isprintable():
        # Non-ASCII (a lone surrogate included) belongs percent-encoded in a URL; a control
        # character (NUL) would reach a socket path or a host name.
        raise _url_error(url, "only printable ASCII characters; percent-encode the rest")
    try:
        parts = urlsplit(url)
        _ = parts.port  # a port out of [0, 65535] or not a number raises here
    except ValueError as exc:
        raise _url_error(url, str(exc)) from None
    if parts.scheme not in ("redis", "rediss", "unix") or not url.lower().startswith(parts.scheme + "://"):
        raise _url_error(url, "the scheme is redis://, rediss:// or unix://")
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name not in _URL_OPTIONS:
            raise _url_error(
                url,
                f"query option {name!r}: RedisStore takes only ?db=N; the timeout is timeout_s",
            )
        if not value.isdigit():
            raise _url_error(url, f"db is a non-negative integer, got {value!r}")
    # redis-py unquotes the host and the socket path: they are checked as it will use them.
    if parts.scheme == "unix":
        path = unquote(parts.path)
        if not path or not path.isprintable():
            raise _url_error(url, "unix:// needs a socket path of printable characters")
        return url
    host = unquote(parts.hostname or "")
    if not host.isprintable():
        raise _url_error(url, "the host name has a control character")
    if len(host) > _MAX_HOST_CHARS:
        raise _url_error(url, f"a host name has at most {_MAX_HOST_CHARS} characters")
    try:
        host.encode("idna")  # what getaddrinfo does with it: a label over 63 characters fails
    except UnicodeError as exc:
        raise _url_error(url, f"bad host name: {exc}") from None
    db = parts.path.strip("/")
    if db and not db.isdigit():  # redis-py would quietly use db 0
        raise _url_error(url, f"the path is the db number, got {parts.path!r}")
    return url


class RedisStore:
    """A ``BlockStore`` on the Redis server at ``url`` (``redis://[user:password@]host[:port][/db]``,
    ``rediss://`` for TLS, ``unix:///path/to/socket[?db=N]``; no other query option).
    ``timeout_s`` bounds every socket connect, read and write."""

    def __init__(
        self,
        url: str,
        *,
        namespace: str | bytes = "pagedkv",
        ttl_s: float | None = None,
        timeout_s: float = 1.0,
    ):
        url = _check_url(url)
        if isinstance(namespace, str):
            try:
                namespace = namespace.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise InvalidArgumentError(f"namespace is valid Unicode text ({exc.reason})") from None
        if not isinstance(namespace, bytes) or not namespace:
            raise InvalidArgumentError("namespace is a non-empty str or bytes")
        ttl = None if ttl_s is None else seconds("ttl_s", ttl_s, positive=True)
        timeout = seconds("timeout_s", timeout_s, positive=True)
        redis = _redis_module()
        try:
            self._client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        except ValueError as exc:
            raise _url_error(url, str(exc)) from exc
        self._url = url
        self._prefix = namespace + b":"
        self._ttl_ms = None if ttl is None else max(1, int(ttl * 1000))
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
        except Exception as exc:  # noqa: BLE001 - any client failure is a miss
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
        except Exception as exc:  # noqa: BLE001 - any client failure is a miss
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
        except Exception as exc:  # noqa: BLE001 - any client failure is a miss
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
        except Exception as exc:  # noqa: BLE001 - any client failure is a miss
            self._error("contains", exc)
            return [False] * len(redis_keys)

    def delete(
        self, block_hash: int | bytes, *, extra_key: object = None, kv_cache_dtype: str | None = None
    ) -> bool:
        return self._delete_key(self._key(block_hash, extra_key, kv_cache_dtype)[1])

    def _delete_key(self, redis_key: bytes) -> bool:
        try:
            return bool(self._client.delete(redis_key))
        except Exception as exc:  # noqa: BLE001 - any client failure is a miss
            self._error("delete", exc)
            return False

    def close(self) -> None:
        """Close the connection pool (a later call reconnects)."""
        try:
            self._client.close()
        except Exception as exc:  # noqa: BLE001 - any client failure is a miss
            self._error("close", exc)

    def __repr__(self) -> str:
        return f"RedisStore({self._url!r}, namespace={self._prefix[:-1]!r})"
