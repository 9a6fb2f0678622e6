"""Offload stores under hostile files and settings: what someone who can write into a store's
directory, or who picks its URL, salts and timeouts, can do to it. Each case is a miss or a
typed pagedkv error, never a hang, a read as large as the file, or a bare built-in exception.

No test asserts a wall-clock time. A reader stuck on a FIFO would never return: the tests run
it on a thread joined for ``STUCK_S`` and then open the FIFO's other end, so that bug fails the
test instead of hanging the suite."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("xxhash", reason="pagedkv.offload needs the offload extra (xxhash)")

from pagedkv.errors import InvalidArgumentError, InvalidArgumentTypeError, PagedKvError  # noqa: E402
from pagedkv.offload import DiskStore, OffloadWorker, RedisStore, encode_key  # noqa: E402
from pagedkv.offload.codec import HEADER, MAX_META_BYTES  # noqa: E402
from pagedkv.offload.seconds import MAX_SECONDS  # noqa: E402

STUCK_S = 30.0
LONE_SURROGATES = ["\ud800", "tenant-\udfff", "\udc80"]


def entry_path(store: DiskStore) -> Path:
    (path,) = store.path.glob("*.blk")
    return path


def release_fifo(path: Path) -> None:
    """Open the FIFO's writing end once, so that a reader blocked opening it returns."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass  # no reader is waiting: nothing to release


def run_in_thread(call):  # type: ignore[no-untyped-def]
    """Runs ``call`` on a daemon thread for at most STUCK_S: (the thread, [its result] once it
    returned)."""
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    thread.join(STUCK_S)
    return thread, result


# -- DiskStore: what is at an entry's name --------------------------------------------------


def test_a_fifo_at_an_entry_name_is_a_counted_miss_not_a_hang(tmp_path):
    store = DiskStore(tmp_path, 1 << 20)
    assert store.put(1, b"payload")
    path = entry_path(store)
    path.unlink()
    os.mkfifo(path)
    assert store.put(2, b"other")
    thread, result = run_in_thread(lambda: store.get(1))
    if thread.is_alive():
        release_fifo(path)
        thread.join(STUCK_S)
        pytest.fail("DiskStore.get blocked opening a FIFO")
    assert result == [None]
    assert store.stats.corrupt_entries == 1 and store.stats.misses == 1
    assert not store.contains(1) and not path.exists()  # dropped: not an entry
    assert store.get(2) == b"other"
    store.check_invariants()


def test_the_worker_is_not_stuck_for_good_by_a_fifo(tmp_path):
    store = DiskStore(tmp_path, 1 << 20)
    assert store.put(1, b"payload")
    path = entry_path(store)
    path.unlink()
    os.mkfifo(path)
    worker = OffloadWorker(store)
    try:
        assert store.put(2, b"after")
        # Key 1 first: a worker stuck on it would never get to key 2.
        assert worker.load([1, 2], STUCK_S) == {2: b"after"}
    finally:
        release_fifo(path)
        worker.close(STUCK_S)


def test_a_symbolic_link_at_an_entry_name_is_not_followed(tmp_path):
    store = DiskStore(tmp_path / "store", 1 << 20)
    assert store.put(1, b"payload")
    path = entry_path(store)
    outside = tmp_path / "outside.blk"
    path.rename(outside)  # the very bytes of the entry, elsewhere
    path.symlink_to(outside)
    assert store.get(1) is None
    assert store.stats.corrupt_entries == 1 and not store.contains(1)
    assert not path.is_symlink() and outside.exists()  # the link went, not what it named
    store.check_invariants()


def test_a_directory_at_an_entry_name_is_a_miss(tmp_path):
    store = DiskStore(tmp_path, 1 << 20)
    assert store.put(1, b"payload")
    path = entry_path(store)
    path.unlink()
    path.mkdir()
    assert store.get(1) is None and store.stats.corrupt_entries == 1
    assert not store.contains(1)
    store.check_invariants()  # a directory is not an entry (as when the store is opened)
    assert store.put(1, b"again") is False  # the rename onto a directory fails: counted
    assert store.get(1) is None and store.stats.failed_puts == 1
    store.check_invariants()


class PreadSpy:
    """Records the length of every ``os.pread``; refuses (returns b"") any read over ``limit``,
    so that a store without the size check fails the test instead of allocating the file."""

    def __init__(self, limit: int):
        self.limit = limit
        self.lengths: list[int] = []
        self._pread = os.pread

    def __call__(self, fd: int, length: int, offset: int) -> bytes:
        self.lengths.append(length)
        return b"" if length > self.limit else self._pread(fd, length, offset)


def test_an_entry_grown_to_2_gib_is_refused_before_it_is_read(tmp_path, monkeypatch):
    store = DiskStore(tmp_path, 1 << 20)
    payload = bytes(range(256)) * 4
    assert store.put(1, payload)
    path = entry_path(store)
    size = path.stat().st_size
    os.truncate(path, 2 << 30)  # sparse: the header is still ours, the size is not
    spy = PreadSpy(limit=size)
    monkeypatch.setattr(os, "pread", spy)
    assert store.get(1) is None
    assert max(spy.lengths, default=0) <= size, spy.lengths
    assert store.stats.corrupt_entries == 1 and not path.exists()


def test_a_header_that_disagrees_with_the_file_size_is_refused_before_the_payload(tmp_path, monkeypatch):
    store = DiskStore(tmp_path, 1 << 20)
    assert store.put(1, b"x" * 4096)
    path = entry_path(store)
    data = bytearray(path.read_bytes())
    # payload_len (the u64 before the checksum) now claims 1 TiB; the file keeps its size.
    data[HEADER.size - 16 : HEADER.size - 8] = (1 << 40).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    spy = PreadSpy(limit=len(data))
    monkeypatch.setattr(os, "pread", spy)
    assert store.get(1) is None
    # One read of the head (bounded by the key and meta sizes), none of the payload.
    assert len(spy.lengths) == 1 and spy.lengths[0] <= HEADER.size + len(encode_key(1)) + MAX_META_BYTES


def test_a_file_replaced_by_another_size_is_a_miss(tmp_path):
    store = DiskStore(tmp_path, 1 << 20)
    assert store.put(1, b"short") and store.put(2, b"a longer payload")
    one, two = (store.path / p.name for p in sorted(store.path.glob("*.blk"), key=lambda p: p.stat().st_size))
    os.replace(two, one)  # key 1's name now holds key 2's (intact, longer) entry
    assert store.get(1) is None and store.stats.corrupt_entries == 1


# -- caller mistakes: typed errors ----------------------------------------------------------


def test_a_masked_array_is_refused_and_a_memmap_stores_as_a_plain_array(tmp_path):
    store = DiskStore(tmp_path, 1 << 20)
    masked = np.ma.masked_array([1.0, 2.0, 3.0], mask=[0, 1, 0])
    with pytest.raises(InvalidArgumentTypeError, match="masked"):
        store.put(1, masked)
    with OffloadWorker(store) as worker, pytest.raises(InvalidArgumentTypeError, match="masked"):
        worker.submit_put(1, masked)
    assert list(store.path.iterdir()) == [] and store.stats.puts == 0
    mapped = np.memmap(tmp_path / "m.bin", dtype=np.float32, mode="w+", shape=(2, 3))
    mapped[:] = np.arange(6).reshape(2, 3)
    for h, array in ((2, mapped), (3, mapped[:, ::2])):
        assert store.put(h, array)
        got = store.get(h)
        assert type(got) is np.ndarray and got.shape == array.shape
        np.testing.assert_array_equal(got, np.asarray(array))


class BytesPath:
    def __fspath__(self) -> bytes:
        return b"/tmp/x"


@pytest.mark.parametrize(
    ("path", "error"),
    [
        ("store\0dir", InvalidArgumentError),
        ("store/\ud800", InvalidArgumentError),
        (BytesPath(), InvalidArgumentTypeError),
    ],
)
def test_a_path_no_file_system_takes_is_a_typed_error(tmp_path, path, error):
    if isinstance(path, str):
        path = str(tmp_path / path)
    with pytest.raises(error):
        DiskStore(path, 1 << 20)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("salt", LONE_SURROGATES)
def test_a_lone_surrogate_salt_is_a_typed_error(tmp_path, salt):
    store = DiskStore(tmp_path, 1 << 20)
    with pytest.raises(InvalidArgumentError):
        encode_key(1, salt)
    for call in (
        lambda: store.put(1, b"x", extra_key=salt),
        lambda: store.get(1, extra_key=salt),
        lambda: store.contains(1, extra_key=salt),
        lambda: store.delete(1, extra_key=salt),
    ):
        with pytest.raises(InvalidArgumentError):
            call()
    with OffloadWorker(store) as worker:
        for call in (
            lambda: worker.submit_put(1, b"x", extra_key=salt),
            lambda: worker.load([1], 1.0, extra_key=salt),
            lambda: worker.prefetch([1], extra_key=salt),
        ):
            with pytest.raises(InvalidArgumentError):
                call()
        assert worker.failures == 0
    assert list(tmp_path.iterdir()) == []


HOSTILE_SECONDS = [1e300, 10**400, MAX_SECONDS * 2, -1, -0.5, float("nan"), float("inf"), -float("inf")]


@pytest.mark.parametrize("bad", HOSTILE_SECONDS)
def test_hostile_worker_timeouts_are_typed_errors_and_change_nothing(tmp_path, bad):
    store = DiskStore(tmp_path, 1 << 20)
    assert store.put(1, b"one")
    worker = OffloadWorker(store)
    pending = worker.prefetch([1])
    for call in (
        lambda: worker.load([1], bad),
        lambda: pending.take(bad),
        lambda: worker.flush(bad),
        lambda: worker.close(bad),
    ):
        with pytest.raises(InvalidArgumentError):
            call()
    # Nothing was abandoned or closed by the refused calls.
    assert pending.take(STUCK_S) == {1: b"one"}
    assert worker.load([1], MAX_SECONDS) == {1: b"one"}  # the bound itself is taken
    assert worker.flush(MAX_SECONDS) and worker.close(STUCK_S)
    assert worker.failures == 0 and worker.late_loads == 0


# -- RedisStore: URLs and settings, checked when the store is made ---------------------------


@pytest.fixture
def redis_py():
    return pytest.importorskip("redis", reason="redis-py is not installed: pip install 'pagedkv[offload]'")


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/0?foo=bar",  # a TypeError on every call, before
        "redis://127.0.0.1:6379/0?socket_timeout=-5",
        "redis://127.0.0.1:6379/0?socket_timeout=60",  # silently replaced timeout_s, before
        "redis://127.0.0.1:6379/0?socket_connect_timeout=60",
        "redis://127.0.0.1:6379/0?db=x",
        "redis://127.0.0.1:6379/0?db=",
        "redis://" + "a" * 100_000 + ":6379/0",  # a UnicodeError on every call, before
        "redis://" + "a" * 64 + ".example:6379/0",  # a DNS label has at most 63 characters
        "redis://" + ".".join(["a" * 60] * 5) + ":6379/0",  # a host name at most 253
        "redis://\ud800:6379/0",
        "redis://h\u00e9te:6379/0",
        "redis://ho%00st:6379/0",
        "redis://host:6379/0\x00",
        "redis://host:6379/abc",  # quietly db 0, before
        "redis://host:99999/0",
        "redis://host:port/0",
        "unix:///tmp/redis%00.sock",
        "unix://",
        "http://host:6379/0",
        "redis:host",
        "",
    ],
)
def test_a_url_redis_py_cannot_use_is_refused_when_the_store_is_made(redis_py, url):
    with pytest.raises(InvalidArgumentError):
        RedisStore(url)


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/0",
        "redis://localhost",
        "redis://[::1]:6379/3",
        "rediss://user:p%40ss@cache.example:6380/2",
        "redis://cache.example?db=4",
        "unix:///tmp/redis.sock?db=1",
    ],
)
def test_ordinary_urls_are_taken(redis_py, url):
    store = RedisStore(url, timeout_s=0.25)
    kwargs = store._client.connection_pool.connection_kwargs
    assert kwargs["socket_timeout"] == 0.25 and kwargs["socket_connect_timeout"] == 0.25


def test_hostile_settings_are_typed_errors(redis_py):
    url = "redis://127.0.0.1:6379/0"
    for namespace in LONE_SURROGATES:
        with pytest.raises(InvalidArgumentError):
            RedisStore(url, namespace=namespace)
    for bad in HOSTILE_SECONDS + [0]:
        with pytest.raises(InvalidArgumentError):
            RedisStore(url, timeout_s=bad)
        with pytest.raises(InvalidArgumentError):
            RedisStore(url, ttl_s=bad)


class RaisingClient:
    """A client whose every call raises what redis-py let through before: a bare built-in."""

    def __init__(self, error: BaseException):
        self.error = error

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        def call(*args: object, **kwargs: object) -> object:
            raise self.error

        return call


@pytest.mark.parametrize(
    "error",
    [
        TypeError("AbstractConnection.__init__() got an unexpected keyword argument 'foo'"),
        UnicodeError("encoding with 'idna' codec failed"),
        ValueError("embedded null byte"),
        OverflowError("timeout doesn't fit into C timeval"),
        RuntimeError("a client bug"),
    ],
)
def test_anything_a_client_call_raises_is_a_miss(redis_py, error):
    store = RedisStore("redis://127.0.0.1:6379/0")
    store._client = RaisingClient(error)
    assert store.get(1) is None
    assert store.put(1, b"x") is False
    assert store.contains_many([1, 2]) == [False, False]
    assert store.delete(1) is False
    assert store.capacity_bytes is None
    store.close()
    stats = store.stats
    assert stats.misses == 1 and stats.failed_puts == 1 and stats.errors == 6
    assert type(error).__name__ in (stats.last_error or "")
    assert not isinstance(error, PagedKvError)
