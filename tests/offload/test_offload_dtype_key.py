"""The store key includes the cache's kv_cache_dtype: a quantized block (a row of bytes: codes
and scales) is only ever served to a cache of the dtype that wrote it, since an int8 and an fp8
block of one geometry are byte strings of one length that nothing else tells apart."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("xxhash", reason="pip install 'pagedkv[offload]'")

from pagedkv.attention import QuantizedKvCache  # noqa: E402
from pagedkv.errors import InvalidArgumentError, InvalidArgumentTypeError  # noqa: E402
from pagedkv.offload import DiskStore, OffloadWorker  # noqa: E402
from pagedkv.offload.keys import encode_key  # noqa: E402


def test_unquantized_keys_keep_their_version_1_bytes():
    assert encode_key(5, b"t") == bytes((1,)) + (5).to_bytes(16, "little") + (2).to_bytes(4, "little") + b"t"
    assert encode_key(5, b"t", None) == encode_key(5, b"t")


def test_every_dtype_gets_its_own_key():
    keys = {
        encode_key(5, b"t", d) for d in (None, "float16", "bfloat16", "float32", "int8", "fp8_e4m3", "int4")
    }
    assert len(keys) == 7
    assert encode_key(5, None, "int8") != encode_key(5, b"", "int8")
    assert encode_key(5, b"t", "int4")[0] == 2  # key version 2 carries a dtype
    with pytest.raises(InvalidArgumentError, match="kv_cache_dtype"):
        encode_key(5, None, "fp8")
    with pytest.raises(InvalidArgumentTypeError):
        encode_key(5, None, 8)


def test_8bit_keys_name_the_ue5m3_format_so_e8m0_blocks_are_never_served():
    """Blocks of the first 8-bit format (E8M0 scales; keys named by the bare dtype) decode to
    other values under UE5M3: a store written by that build must not serve them."""
    for dtype in ("int8", "fp8_e4m3"):
        e8m0_key = bytes((2,)) + (5).to_bytes(16, "little") + bytes((len(dtype),)) + dtype.encode()
        e8m0_key += (2).to_bytes(4, "little") + b"t"
        assert encode_key(5, b"t", dtype) != e8m0_key
    int4 = bytes((2,)) + (5).to_bytes(16, "little") + bytes((4,)) + b"int4" + (2).to_bytes(4, "little") + b"t"
    assert encode_key(5, b"t", "int4") == int4  # unchanged format, unchanged key


def _block(dtype: str) -> np.ndarray:
    cache = QuantizedKvCache.empty(dtype, "key", 2, 16, 2, 64)
    cache.data[1] = np.arange(cache.layout.block_bytes) % 251
    return cache.data[1]


def test_a_stored_quantized_block_comes_back_only_under_its_dtype(tmp_path):
    store = DiskStore(tmp_path / "s", capacity_bytes=1 << 20)
    block = _block("int8")
    assert block.shape == _block("fp8_e4m3").shape  # the bytes alone cannot tell them apart
    assert store.put(7, block, extra_key=b"m", kv_cache_dtype="int8")
    got = store.get(7, extra_key=b"m", kv_cache_dtype="int8")
    np.testing.assert_array_equal(got, block)
    assert store.get(7, extra_key=b"m", kv_cache_dtype="fp8_e4m3") is None
    assert store.get(7, extra_key=b"m") is None
    assert store.contains_many([7, 8], extra_key=b"m", kv_cache_dtype="int8") == [True, False]
    assert not store.contains(7, extra_key=b"m", kv_cache_dtype="int4")
    assert store.delete(7, extra_key=b"m", kv_cache_dtype="int8")
    assert not store.contains(7, extra_key=b"m", kv_cache_dtype="int8")


def test_the_worker_passes_the_dtype_to_the_store(tmp_path):
    store = DiskStore(tmp_path / "s", capacity_bytes=1 << 20)
    block = _block("int4")
    with OffloadWorker(store) as worker:
        assert worker.submit_put(9, block, extra_key=b"m", kv_cache_dtype="int4")
        assert worker.flush(timeout_s=5.0)
        assert set(worker.load([9], deadline_s=5.0, extra_key=b"m", kv_cache_dtype="int4")) == {9}
        assert worker.load([9], deadline_s=5.0, extra_key=b"m", kv_cache_dtype="int8") == {}
        assert worker.prefetch([9], extra_key=b"m", kv_cache_dtype="int4").take(5.0).keys() == {9}
        with pytest.raises(InvalidArgumentError):
            worker.submit_put(9, block, kv_cache_dtype="int2")
    assert store.contains(9, extra_key=b"m", kv_cache_dtype="int4")


class _OldStore:
    """A store written before quantized caches: no kv_cache_dtype keyword anywhere."""

    def __init__(self) -> None:
        self.data: dict[int, object] = {}

    def put(self, block_hash, payload, *, extra_key=None):
        self.data[int(block_hash)] = payload
        return True

    def get(self, block_hash, *, extra_key=None):
        return self.data.get(int(block_hash))

    def contains(self, block_hash, *, extra_key=None):
        return int(block_hash) in self.data

    def contains_many(self, block_hashes, *, extra_key=None):
        return [self.contains(h) for h in block_hashes]

    def delete(self, block_hash, *, extra_key=None):
        return self.data.pop(int(block_hash), None) is not None

    capacity_bytes = None
    usage_bytes = 0
    stats = None


def test_a_store_without_the_dtype_keyword_still_serves_unquantized_blocks():
    store = _OldStore()
    with OffloadWorker(store) as worker:
        assert worker.submit_put(3, b"abc", if_absent=True)
        assert worker.flush(timeout_s=5.0)
        assert worker.load([3], deadline_s=5.0) == {3: b"abc"}


def test_redis_keys_carry_the_dtype(redis_server):
    import redis
    from pagedkv.offload import RedisStore

    store = RedisStore(redis_server.url)
    block = _block("fp8_e4m3")
    assert store.put(4, block, kv_cache_dtype="fp8_e4m3")
    assert store.get(4, kv_cache_dtype="int8") is None and store.get(4) is None
    np.testing.assert_array_equal(store.get(4, kv_cache_dtype="fp8_e4m3"), block)
    assert store.contains_many([4], kv_cache_dtype="fp8_e4m3") == [True]
    keys = redis.Redis.from_url(redis_server.url).keys(b"*")
    assert keys == [b"pagedkv:" + encode_key(4, None, "fp8_e4m3")]
    assert store.delete(4, kv_cache_dtype="fp8_e4m3") and not store.contains(4, kv_cache_dtype="fp8_e4m3")
