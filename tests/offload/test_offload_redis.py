"""RedisStore against a real ``redis-server`` (started per test on a free port, no
persistence): round trips, tenant and namespace isolation, a corrupted value and a server
restart turning into misses."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("xxhash", reason="pagedkv.offload needs the offload extra (xxhash)")

from offload_helpers import SMOLLM2_BLOCK_SHAPE  # noqa: E402
from pagedkv.errors import InvalidArgumentError, InvalidArgumentTypeError  # noqa: E402
from pagedkv.offload import BlockStore, RedisStore  # noqa: E402
from pagedkv.offload.keys import encode_key  # noqa: E402


def raw_client(server):
    import redis

    return redis.Redis.from_url(server.url)


def test_round_trips_bytes_and_arrays(redis_server):
    store = RedisStore(redis_server.url)
    assert isinstance(store, BlockStore)
    rng = np.random.default_rng(1)
    block = rng.standard_normal(SMOLLM2_BLOCK_SHAPE).astype(np.float32)
    assert store.put(1, b"bytes") and store.put(2, block) and store.put(3, block.astype(np.float16))
    assert store.get(1) == b"bytes"
    for h, want in ((2, block), (3, block.astype(np.float16))):
        got = store.get(h)
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    assert store.get(4) is None
    assert store.contains_many([1, 4, 2]) == [True, False, True]
    assert store.delete(1) and not store.contains(1)
    assert store.stats.hits == 3 and store.stats.misses == 1


def test_tenants_and_namespaces_never_share_an_entry(redis_server):
    a = RedisStore(redis_server.url, namespace="deploy-a")
    b = RedisStore(redis_server.url, namespace="deploy-b")
    assert a.put(7, b"a/t1", extra_key=b"t1")
    assert a.get(7, extra_key=b"t2") is None and a.get(7) is None
    assert b.get(7, extra_key=b"t1") is None
    assert a.get(7, extra_key=b"t1") == b"a/t1"
    keys = raw_client(redis_server).keys(b"*")
    assert keys == [b"deploy-a:" + encode_key(7, b"t1")]


def test_a_corrupted_value_is_a_miss_and_is_deleted(redis_server):
    store = RedisStore(redis_server.url)
    client = raw_client(redis_server)
    store.put(5, b"payload" * 100)
    redis_key = b"pagedkv:" + encode_key(5)
    value = bytearray(client.get(redis_key))
    for bad in (bytes(value[:-1]), bytes(value[:10]), b"", bytes(value) + b"x"):
        client.set(redis_key, bad)
        assert store.get(5) is None
        assert not client.exists(redis_key)
    value[-3] ^= 0x40
    client.set(redis_key, bytes(value))
    assert store.get(5) is None and store.stats.corrupt_entries == 5


def test_a_redis_restart_is_misses_then_hits_again(redis_server):
    store = RedisStore(redis_server.url, timeout_s=0.5)
    assert store.put(1, b"before")
    redis_server.kill()
    assert store.get(1) is None  # server down: a miss, not an exception
    assert store.put(2, b"down") is False
    assert store.contains_many([1, 2]) == [False, False]
    assert store.delete(1) is False
    assert store.capacity_bytes is None
    assert store.stats.errors >= 4 and store.stats.last_error is not None
    redis_server.start()  # a restarted cache server comes back empty
    assert store.get(1) is None
    assert store.put(3, b"after") and store.get(3) == b"after"


def test_ttl_and_capacity_reach_the_server(redis_server):
    client = raw_client(redis_server)
    client.config_set("maxmemory", 64 << 20)
    store = RedisStore(redis_server.url, ttl_s=30)
    assert store.capacity_bytes == 64 << 20
    store.put(1, b"x")
    assert 0 < client.pttl(b"pagedkv:" + encode_key(1)) <= 30_000
    forever = RedisStore(redis_server.url, namespace="forever")
    forever.put(1, b"x")
    assert client.pttl(b"forever:" + encode_key(1)) == -1  # no expiry
    assert store.usage_bytes > 1


def test_caller_mistakes_are_typed_errors(redis_server):
    store = RedisStore(redis_server.url)
    with pytest.raises(InvalidArgumentTypeError):
        store.put("1", b"x")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentTypeError):
        store.put(1, "text")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentTypeError):
        store.get(1, extra_key=3.0)
    with pytest.raises(InvalidArgumentError):
        store.contains_many([1, -5])
    with pytest.raises(InvalidArgumentTypeError):
        RedisStore(1234)  # type: ignore[arg-type]
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(InvalidArgumentError):
            RedisStore(redis_server.url, ttl_s=bad)
        with pytest.raises(InvalidArgumentError):
            RedisStore(redis_server.url, timeout_s=bad)
    with pytest.raises(InvalidArgumentTypeError):
        RedisStore(redis_server.url, ttl_s="5")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        RedisStore(redis_server.url, namespace="")
    with pytest.raises(InvalidArgumentError):
        RedisStore("http://not-redis/")
    assert raw_client(redis_server).dbsize() == 0
