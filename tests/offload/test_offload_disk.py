"""DiskStore: round trips, salt isolation, LRU eviction by bytes, and every way a file can be
bad (truncated, flipped, left by a killed writer, a full disk) turning into a miss."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("xxhash", reason="pagedkv.offload needs the offload extra (xxhash)")

from offload_helpers import SMOLLM2_BLOCK_SHAPE  # noqa: E402
from pagedkv.errors import (  # noqa: E402
    InvalidArgumentError,
    InvalidArgumentTypeError,
    InvariantViolation,
)
from pagedkv.offload import BlockStore, DiskStore  # noqa: E402
from pagedkv.offload.codec import HEADER, decode_entry, encode_entry  # noqa: E402
from pagedkv.offload.keys import encode_key  # noqa: E402


def entries(store: DiskStore) -> list[Path]:
    return sorted(store.path.glob("*.blk"))


def test_disk_store_is_a_block_store(tmp_path):
    assert isinstance(DiskStore(tmp_path, 1 << 20), BlockStore)


@pytest.mark.parametrize("payload", [b"", b"x", bytes(range(256)) * 9, bytearray(b"abc")])
def test_bytes_round_trip(tmp_path, payload):
    store = DiskStore(tmp_path, 1 << 20)
    assert store.put(7, payload)
    got = store.get(7)
    assert type(got) is bytes and got == bytes(payload)
    assert store.contains(7) and store.stats.hits == 1


@pytest.mark.parametrize(
    "dtype", ["float32", "float16", "float64", "int8", "uint8", "int32", "uint64", "bool", "complex64", ">f4"]
)
def test_array_round_trip_keeps_dtype_and_shape(tmp_path, dtype):
    store = DiskStore(tmp_path, 1 << 22)
    rng = np.random.default_rng(0)
    array = (rng.standard_normal((3, 2, 5)) * 50).astype(dtype)
    assert store.put(1, array)
    got = store.get(1)
    assert isinstance(got, np.ndarray)
    assert got.dtype == array.dtype and got.shape == array.shape
    np.testing.assert_array_equal(got, array)


def test_array_edge_shapes_and_a_noncontiguous_view(tmp_path):
    store = DiskStore(tmp_path, 1 << 22)
    block = np.arange(np.prod(SMOLLM2_BLOCK_SHAPE), dtype=np.float32).reshape(SMOLLM2_BLOCK_SHAPE)
    cases = [np.array(3.5, dtype=np.float32), np.zeros((0, 4), np.float16), block[:, 1, ::2], block]
    for i, array in enumerate(cases):
        assert store.put(i, array)
    for i, array in enumerate(cases):
        got = store.get(i)
        assert isinstance(got, np.ndarray) and got.shape == array.shape
        np.testing.assert_array_equal(got, array)


def test_a_hash_as_16_little_endian_bytes_is_the_same_key(tmp_path):
    store = DiskStore(tmp_path, 1 << 20)
    h = (1 << 127) + 12345
    assert store.put(h.to_bytes(16, "little"), b"v")
    assert store.get(h) == b"v" and store.get(h.to_bytes(16, "big")) is None


def test_salt_isolation(tmp_path):
    store = DiskStore(tmp_path, 1 << 20)
    assert store.put(42, b"tenant-a", extra_key=b"a")
    assert store.put(42, b"no salt")
    assert store.get(42, extra_key=b"b") is None
    assert store.get(42, extra_key=b"") is None  # an empty salt is not no salt
    assert store.get(42, extra_key="a") == b"tenant-a"  # str salts are their UTF-8 bytes
    assert store.get(42) == b"no salt"
    assert store.contains_many([42, 43], extra_key=b"a") == [True, False]
    assert store.delete(42, extra_key=b"a") and not store.delete(42, extra_key=b"a")
    assert store.get(42) == b"no salt"


def test_lru_eviction_by_bytes(tmp_path):
    one = len(entries_of_size(tmp_path / "probe"))
    store = DiskStore(tmp_path / "s", 3 * one)
    for h in (1, 2, 3):
        assert store.put(h, bytes(1000))
    assert store.get(1) is not None  # 1 is now the most recent: 2 goes first
    assert store.put(4, bytes(1000))
    assert [store.contains(h) for h in (1, 2, 3, 4)] == [True, False, True, True]
    assert store.usage_bytes == 3 * one <= store.capacity_bytes
    assert len(entries(store)) == 3 and store.stats.evictions == 1
    assert store.put(5, bytes(2500))  # a bigger entry evicts as many as it needs
    assert store.usage_bytes <= store.capacity_bytes
    assert sum(p.stat().st_size for p in entries(store)) == store.usage_bytes


def entries_of_size(path: Path) -> bytes:
    probe = DiskStore(path, 1 << 20)
    probe.put(1, bytes(1000))
    return entries(probe)[0].read_bytes()


def test_an_entry_larger_than_the_capacity_is_a_failed_put(tmp_path):
    store = DiskStore(tmp_path, 100)
    assert not store.put(1, bytes(200))
    assert store.stats.failed_puts == 1 and "capacity" in (store.stats.last_error or "")
    assert list(tmp_path.iterdir()) == []


def test_reopening_keeps_entries_and_applies_the_new_capacity(tmp_path):
    store = DiskStore(tmp_path, 1 << 20)
    for h in range(5):
        assert store.put(h, bytes([h]) * 1000)
    size = store.usage_bytes // 5
    reopened = DiskStore(tmp_path, 1 << 20)
    assert [reopened.get(h) for h in range(5)] == [bytes([h]) * 1000 for h in range(5)]
    smaller = DiskStore(tmp_path, 2 * size)
    assert len(smaller) == 2 and len(entries(smaller)) == 2


# -- bad files --------------------------------------------------------------------------------


def test_a_truncated_entry_is_a_miss_and_is_deleted(tmp_path):
    store = DiskStore(tmp_path, 1 << 20)
    store.put(1, bytes(range(200)))
    path = entries(store)[0]
    path.write_bytes(path.read_bytes()[:-1])
    assert store.get(1) is None
    assert store.stats.corrupt_entries == 1 and not path.exists() and not store.contains(1)
    assert store.usage_bytes == 0


def test_every_flipped_byte_is_a_miss(tmp_path):
    store = DiskStore(tmp_path, 1 << 20)
    array = np.arange(12, dtype=np.int16).reshape(3, 4)
    store.put(9, array, extra_key=b"salt")
    original = entries(store)[0].read_bytes()
    for offset in range(len(original)):  # header, key, meta and payload bytes alike
        store.put(9, array, extra_key=b"salt")
        path = entries(store)[0]
        data = bytearray(original)
        data[offset] ^= 0x01
        path.write_bytes(bytes(data))
        assert store.get(9, extra_key=b"salt") is None, offset
    assert store.stats.corrupt_entries == len(original)


def test_another_keys_file_under_this_name_is_a_miss(tmp_path):
    store = DiskStore(tmp_path, 1 << 20)
    store.put(1, b"one")
    store.put(2, b"two")
    one, two = entries(store)
    data_one = one.read_bytes()
    target = two if b"two" in two.read_bytes() else one
    other = one if target is two else two
    target.write_bytes(other.read_bytes() if other != target else data_one)
    results = [store.get(1), store.get(2)]
    assert results.count(None) == 1 and store.stats.corrupt_entries == 1


def test_a_short_file_of_garbage_is_a_miss(tmp_path):
    store = DiskStore(tmp_path, 1 << 20)
    store.put(1, b"one")
    entries(store)[0].write_bytes(b"PKVO" + b"\0" * (HEADER.size - 8))
    assert store.get(1) is None


WRITER = textwrap.dedent(
    """
    import os, sys, time
    from pagedkv.offload import DiskStore
    store = DiskStore(sys.argv[1], 1 << 24)
    store.put(1, b"complete" * 1000)
    real_write = os.write
    state = {"calls": 0}
    def half_then_hang(fd, data):
        state["calls"] += 1
        if state["calls"] == 2:  # the payload: write half of it, then stall until killed
            n = real_write(fd, bytes(data)[: len(data) // 2])
            print("HALF", flush=True)
            time.sleep(3600)  # killed long before: a minute was a bound on the parent's speed
            return n
        return real_write(fd, data)
    os.write = half_then_hang
    store.put(2, b"torn" * 100000)
    """
)


def test_a_writer_killed_mid_file_never_serves_its_block(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, env=env)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == b"HALF"
        child.send_signal(signal.SIGKILL)
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert len(list(tmp_path.glob("*.tmp"))) == 1  # the half-written entry, never renamed
    store = DiskStore(tmp_path, 1 << 24)
    assert list(tmp_path.glob("*.tmp")) == []  # opening removes it
    assert store.get(1) == b"complete" * 1000
    assert store.get(2) is None and len(store) == 1


def test_a_full_disk_is_a_failed_put_not_an_exception(tmp_path, monkeypatch):
    store = DiskStore(tmp_path, 1 << 24)
    assert store.put(1, b"kept")
    real_write = os.write

    def enospc_after_a_few_bytes(fd, data):
        if len(data) > 64:
            real_write(fd, bytes(data)[:64])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", enospc_after_a_few_bytes)
    assert store.put(2, bytes(10_000)) is False
    assert store.put(1, bytes(10_000)) is False  # a failed overwrite keeps the old entry
    monkeypatch.undo()
    assert store.stats.failed_puts == 2
    assert os.strerror(errno.ENOSPC) in (store.stats.last_error or "")
    assert list(tmp_path.glob("*.tmp")) == []
    assert store.get(2) is None and store.get(1) == b"kept"
    assert store.put(2, b"fine again") and store.get(2) == b"fine again"


FILE_SIZE_LIMITED = textwrap.dedent(
    """
    import resource, signal, sys
    from pagedkv.offload import DiskStore
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
    store = DiskStore(sys.argv[1], 1 << 24)
    big = store.put(1, bytes(200_000))
    small = store.put(2, b"fits")
    print(big, small, store.get(1), store.get(2), store.stats.failed_puts,
          sorted(p.suffix for p in store.path.iterdir()))
    """
)


def test_a_real_write_error_from_the_kernel_is_a_failed_put(tmp_path):
    # The kernel refusing a write mid-file (a per-process file size limit: EFBIG, the same
    # path through os.write as ENOSPC on a full disk), without mocking os.write.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", FILE_SIZE_LIMITED, str(tmp_path)],
        capture_output=True,
        env=env,
        timeout=120,
        check=True,
    ).stdout.decode()
    assert out.split() == ["False", "True", "None", "b'fits'", "1", "['.blk']"], out


def test_a_vanished_directory_is_a_failed_put_and_a_miss(tmp_path):
    store = DiskStore(tmp_path / "d", 1 << 20)
    store.put(1, b"x")
    for path in (tmp_path / "d").iterdir():
        path.unlink()
    (tmp_path / "d").rmdir()
    assert store.get(1) is None
    assert store.put(2, b"y") is False


# -- caller mistakes --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("block_hash", "error"),
    [
        ("12", InvalidArgumentTypeError),
        (1.0, InvalidArgumentTypeError),
        (None, InvalidArgumentTypeError),
        (True, InvalidArgumentTypeError),
        (-1, InvalidArgumentError),
        (1 << 128, InvalidArgumentError),
        (b"\0" * 15, InvalidArgumentError),
    ],
)
def test_a_hostile_hash_is_a_typed_error(tmp_path, block_hash, error):
    store = DiskStore(tmp_path, 1 << 20)
    for call in (
        lambda: store.put(block_hash, b"x"),
        lambda: store.get(block_hash),
        lambda: store.contains(block_hash),
        lambda: store.delete(block_hash),
    ):
        with pytest.raises(error):
            call()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "payload",
    [
        "text",
        [1, 2],
        None,
        3,
        np.array([object()]),
        np.zeros(2, dtype=[("a", "f4")]),
        np.array(["s"]),
        np.zeros(2, dtype="M8[s]"),
    ],
)
def test_a_hostile_payload_is_a_typed_error(tmp_path, payload):
    store = DiskStore(tmp_path, 1 << 20)
    with pytest.raises(InvalidArgumentTypeError):
        store.put(1, payload)
    assert list(tmp_path.iterdir()) == [] and store.stats.puts == 0


def test_hostile_salts_and_constructor_arguments_are_typed_errors(tmp_path):
    store = DiskStore(tmp_path, 1 << 20)
    with pytest.raises(InvalidArgumentTypeError):
        store.put(1, b"x", extra_key=5)
    with pytest.raises(InvalidArgumentError):
        store.get(1, extra_key=b"s" * 5000)
    with pytest.raises(InvalidArgumentTypeError):
        DiskStore(tmp_path, 1.5)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentTypeError):
        DiskStore(tmp_path, True)
    with pytest.raises(InvalidArgumentError):
        DiskStore(tmp_path, 0)
    with pytest.raises(InvalidArgumentTypeError):
        DiskStore(3, 100)  # type: ignore[arg-type]


# -- model-based ------------------------------------------------------------------------------

ops = st.lists(
    st.tuples(
        st.sampled_from(["put", "get", "delete"]),
        st.integers(0, 7),
        st.sampled_from([None, b"a", b"b"]),
        st.integers(0, 600),
    ),
    max_size=40,
)


def entry_bytes(salt: bytes | None, payload_len: int) -> int:
    # header | key (version 1 + hash 16 + salt tag 4 + salt) | payload (bytes: no meta)
    return HEADER.size + 21 + len(salt or b"") + payload_len


@settings(max_examples=40)
@given(ops=ops)
def test_disk_store_matches_an_lru_model(tmp_path_factory, ops):
    capacity = 3 * entry_bytes(b"a", 600)
    store = DiskStore(tmp_path_factory.mktemp("model"), capacity)
    model: OrderedDict[tuple[int, bytes | None], bytes] = OrderedDict()  # least recent first

    def used() -> int:
        return sum(entry_bytes(salt, len(v)) for (_, salt), v in model.items())

    for op, h, salt, n in ops:
        k = (h, salt)
        if op == "put":
            payload = bytes([h]) * n
            assert store.put(h, payload, extra_key=salt)
            model.pop(k, None)
            while model and used() + entry_bytes(salt, n) > capacity:
                model.popitem(last=False)
            model[k] = payload
        elif op == "get":
            assert store.get(h, extra_key=salt) == model.get(k)
            if k in model:
                model.move_to_end(k)
        else:
            assert store.delete(h, extra_key=salt) == (k in model)
            model.pop(k, None)
        assert store.usage_bytes == used() <= capacity
        assert len(entries(store)) == len(store) == len(model)
        store.check_invariants()


def test_check_invariants_sees_a_stray_or_missing_file(tmp_path):
    store = DiskStore(tmp_path, 1 << 20)
    store.put(1, b"x")
    store.check_invariants()
    (tmp_path / ("0" * 40 + ".blk")).write_bytes(b"stray")
    with pytest.raises(InvariantViolation):
        store.check_invariants()
    (tmp_path / ("0" * 40 + ".blk")).unlink()
    entries(store)[0].unlink()
    with pytest.raises(InvariantViolation):
        store.check_invariants()


def test_threads_sharing_a_store_keep_it_consistent(tmp_path):
    # The worker thread and the step's thread share one store: interleaved puts, gets and
    # deletes of overlapping keys never serve a wrong payload nor break the byte accounting.
    store = DiskStore(tmp_path, 6 * entry_bytes(None, 2000))
    errors: list[BaseException] = []

    def payload(h: int) -> bytes:
        return bytes([h]) * (1000 + 100 * h)

    def hammer(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(300):
                h = int(rng.integers(0, 10))
                op = rng.integers(0, 3)
                if op == 0:
                    assert store.put(h, payload(h))
                elif op == 1:
                    assert store.get(h) in (None, payload(h))
                else:
                    store.delete(h)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    store.check_invariants()
    assert store.stats.corrupt_entries == 0


# -- the codec against hostile bytes ----------------------------------------------------------


@settings(max_examples=300)
@given(data=st.binary(max_size=200))
def test_random_bytes_never_decode(data):
    assert decode_entry(data, encode_key(1)) is None


@settings(max_examples=300)
@given(
    shape=st.lists(st.integers(0, 3), max_size=3),
    dtype=st.sampled_from(["<f4", ">i2", "u1", "?", "<c8"]),
    cut=st.integers(0, 400),
    flips=st.lists(st.tuples(st.integers(0, 400), st.integers(1, 255)), max_size=3),
)
def test_a_damaged_entry_decodes_to_none_or_to_the_original(shape, dtype, cut, flips):
    array = (np.arange(int(np.prod(shape)), dtype=np.int64) % 7).astype(dtype).reshape(shape)
    key = encode_key(5, b"t")
    data = bytearray(b"".join(bytes(p) for p in encode_entry(key, array)))
    for offset, mask in flips:
        data[offset % len(data)] ^= mask
    data = data[: len(data) - cut % (len(data) + 1)] if cut % 2 else data
    got = decode_entry(bytes(data), key)
    if got is not None:  # only an undamaged entry decodes (a flip twice at one offset undoes)
        assert isinstance(got, np.ndarray) and got.dtype == array.dtype
        np.testing.assert_array_equal(got, array)
