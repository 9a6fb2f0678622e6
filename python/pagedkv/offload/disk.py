"""``DiskStore``: KV blocks in a local directory, one file per block, LRU-bounded by bytes.

Why one file per block rather than an append-only segment with an index:

- Crash safety without a log. An entry is written to a temporary name and renamed into place;
  ``rename`` is atomic, so a reader sees either no file or a whole one. A crash of the machine
  (not only of the process) can still leave a renamed file whose data never reached the disk
  when ``fsync`` is off, which is why every entry also carries its length and an XXH3 checksum
  (``codec.py``): a torn or truncated file decodes to a miss and is deleted. Temporary files
  a killed writer left behind are removed when the store is opened.
- fsync is optional (``fsync=False`` by default). The store is a cache: losing the last
  entries written before a power cut costs recomputation, never wrong K/V, because the checksum
  rejects what did not land. ``fsync=True`` makes a returned ``put`` durable, at one flush per
  block.
- Eviction by bytes is an ``unlink``. A segment file cannot give space back without
  compaction (rewriting the live entries), and an LRU cache evicts constantly; per-block files
  let the file system reclaim the space at once and keep the index a plain ``OrderedDict``.

The cost is one file-system entry per block (a SmolLM2 block is ~720 KiB, so a 100 GiB store
is ~150 k files, flat in one directory, which ext4 and XFS index by hash). The index lives in
memory and is rebuilt from the directory when the store is opened, in modification-time order
(recency across a restart is approximated by write time). One ``DiskStore`` per directory at a
time: two processes sharing a directory would each evict by their own index.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

from pagedkv.errors import InvalidArgumentError, InvalidArgumentTypeError, InvariantViolation
from pagedkv.offload.codec import (
    HEADER,
    MAX_META_BYTES,
    Payload,
    decode_parts,
    encode_entry,
    entry_extent,
    entry_size,
)
from pagedkv.offload.keys import encode_key
from pagedkv.offload.store import StoreStats

__all__ = ["DiskStore"]

_SUFFIX = ".blk"
_TMP_SUFFIX = ".tmp"
# An entry is opened without following a symbolic link and without waiting: a FIFO put at an
# entry's name would otherwise block the reading thread until something writes to it.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# What opening such a name fails with: a symbolic link (ELOOP), a socket (ENXIO).
_NOT_AN_ENTRY_ERRNOS = (errno.ELOOP, errno.ENXIO)


def _file_stem(key: bytes) -> str:
    # The key holds an arbitrary salt: name the file by a digest and keep the full key in the
    # entry, which the decoder compares (a digest collision is then a miss, not a wrong block).
    return hashlib.blake2b(key, digest_size=20).hexdigest()


def _checked_path(path: object) -> str:
    """``path`` as a ``str`` the operating system can take, or a typed error: a NUL byte or a
    lone surrogate (no file name has either) is ``InvalidArgumentError``, not ``ValueError`` /
    ``UnicodeEncodeError`` from deep inside ``mkdir``."""
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidArgumentTypeError(f"path is a str or a path, not {type(path).__name__}")
    raw = os.fspath(path)
    if not isinstance(raw, str):
        raise InvalidArgumentTypeError(f"path is a str or a path to a str, not {type(raw).__name__}")
    if "\0" in raw:
        raise InvalidArgumentError(f"path has a NUL character: {raw!r}")
    try:
        os.fsencode(raw)
    except UnicodeEncodeError as exc:
        raise InvalidArgumentError(f"path is not a valid file name ({exc.reason}): {raw!r}") from None
    return raw


class DiskStore:
    """A ``BlockStore`` in the directory ``path`` holding at most ``capacity_bytes`` (entry
    files with their headers; least recently used entries are evicted first)."""

    def __init__(self, path: str | os.PathLike[str], capacity_bytes: int, *, fsync: bool = False):
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise InvalidArgumentTypeError(f"capacity_bytes is an int, not {type(capacity_bytes).__name__}")
        if capacity_bytes <= 0:
            raise InvalidArgumentError(f"capacity_bytes is positive, got {capacity_bytes}")
        self._dir = Path(_checked_path(path))
        self._dir.mkdir(parents=True, exist_ok=True)
        self._capacity = capacity_bytes
        self._fsync = fsync
        self._lock = threading.RLock()  # _fail takes it again inside put
        self._index: OrderedDict[str, int] = OrderedDict()  # file stem -> bytes, LRU first
        self._usage = 0
        self._tmp_counter = 0
        self._stats = StoreStats()
        self._recover()

    # -- opening -------------------------------------------------------------------------

    def _recover(self) -> None:
        found: list[tuple[int, str, int]] = []
        with os.scandir(self._dir) as entries:
            for entry in entries:
                if not entry.is_file(follow_symlinks=False):
                    continue
                if entry.name.endswith(_TMP_SUFFIX):
                    self._unlink(entry.path)  # a writer died before its rename
                elif entry.name.endswith(_SUFFIX):
                    st = entry.stat(follow_symlinks=False)
                    found.append((st.st_mtime_ns, entry.name[: -len(_SUFFIX)], st.st_size))
        for _, stem, size in sorted(found):
            self._index[stem] = size
            self._usage += size
        with self._lock:
            self._evict_to(self._capacity)

    # -- the protocol --------------------------------------------------------------------

    @property
    def path(self) -> Path:
        return self._dir

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def usage_bytes(self) -> int:
        return self._usage

    @property
    def stats(self) -> StoreStats:
        return self._stats

    def __len__(self) -> int:
        return len(self._index)

    def put(
        self,
        block_hash: int | bytes,
        payload: Payload,
        *,
        extra_key: object = None,
        kv_cache_dtype: str | None = None,
    ) -> bool:
        key = encode_key(block_hash, extra_key, kv_cache_dtype)
        parts = encode_entry(key, payload)
        size = entry_size(parts)
        stem = _file_stem(key)
        if size > self._capacity:
            self._fail(f"entry of {size} bytes exceeds capacity_bytes={self._capacity}")
            return False
        with self._lock:
            self._tmp_counter += 1
            serial = self._tmp_counter
        tmp = self._dir / f"{stem}.{os.getpid()}.{serial}{_TMP_SUFFIX}"
        try:
            self._write_file(tmp, parts)
        except OSError as exc:  # ENOSPC, EIO, a removed directory: a failed put
            self._unlink(str(tmp))
            self._fail(f"put failed: {exc!r}")
            return False
        with self._lock:
            # Make room first, so the directory never holds more than capacity_bytes for long.
            old = self._index.pop(stem, None)
            if old is not None:
                self._usage -= old
            self._evict_to(self._capacity - size)
            try:
                os.replace(tmp, self._dir / (stem + _SUFFIX))
            except OSError as exc:
                self._unlink(str(tmp))
                self._unlink(str(self._dir / (stem + _SUFFIX)))  # the old entry left the index
                self._fail(f"put failed: {exc!r}")
                return False
            self._index[stem] = size
            self._usage += size
            self._stats.puts += 1
        return True

    def get(
        self, block_hash: int | bytes, *, extra_key: object = None, kv_cache_dtype: str | None = None
    ) -> Payload | None:
        key = encode_key(block_hash, extra_key, kv_cache_dtype)
        stem = _file_stem(key)
        with self._lock:
            size = self._index.get(stem)
            if size is None:
                self._stats.misses += 1
                return None
            self._index.move_to_end(stem)
        try:
            payload = self._read_file(self._dir / (stem + _SUFFIX), key, size)
        except OSError as exc:  # evicted meanwhile, or the medium failed
            with self._lock:
                self._stats.misses += 1
                if not isinstance(exc, FileNotFoundError):
                    self._note_error(f"get failed: {exc!r}")
            return None
        with self._lock:
            if payload is None:
                self._stats.corrupt_entries += 1
                self._stats.misses += 1
                if self._index.get(stem) == size:  # else a put replaced the entry meanwhile
                    self._drop(stem)
            else:
                self._stats.hits += 1
        return payload

    def contains(
        self, block_hash: int | bytes, *, extra_key: object = None, kv_cache_dtype: str | None = None
    ) -> bool:
        return _file_stem(encode_key(block_hash, extra_key, kv_cache_dtype)) in self._index

    def contains_many(
        self,
        block_hashes: Iterable[int | bytes],
        *,
        extra_key: object = None,
        kv_cache_dtype: str | None = None,
    ) -> list[bool]:
        return [self.contains(h, extra_key=extra_key, kv_cache_dtype=kv_cache_dtype) for h in block_hashes]

    def delete(
        self, block_hash: int | bytes, *, extra_key: object = None, kv_cache_dtype: str | None = None
    ) -> bool:
        stem = _file_stem(encode_key(block_hash, extra_key, kv_cache_dtype))
        with self._lock:
            return self._drop(stem)

    def check_invariants(self) -> None:
        """Raise ``InvariantViolation`` unless the index and the directory agree: usage is the
        sum of the indexed entries, at most the capacity, and exactly the indexed entries are
        in the directory as regular files with their indexed sizes (no temporary file between
        operations). Anything else at an entry name (a directory, a FIFO, a symbolic link) is
        not an entry, as for ``_recover``."""
        with self._lock:
            if self._usage != sum(self._index.values()) or self._usage > self._capacity:
                raise InvariantViolation(
                    f"usage {self._usage} vs index {sum(self._index.values())}, capacity {self._capacity}"
                )
            on_disk = {}
            with os.scandir(self._dir) as entries:
                for entry in entries:
                    if entry.name.endswith(_TMP_SUFFIX):
                        raise InvariantViolation(f"temporary file left behind: {entry.name}")
                    if entry.name.endswith(_SUFFIX) and entry.is_file(follow_symlinks=False):
                        on_disk[entry.name[: -len(_SUFFIX)]] = entry.stat(follow_symlinks=False).st_size
            if on_disk != dict(self._index):
                raise InvariantViolation("the index and the directory's entry files differ")

    # -- internals -----------------------------------------------------------------------

    def _write_file(self, path: Path, parts: list[bytes | memoryview]) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            for part in parts:
                view = memoryview(part).cast("B")
                while view.nbytes:
                    written = os.write(fd, view)
                    view = view[written:]
            if self._fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    @staticmethod
    def _read_file(path: Path, key: bytes, size: int) -> Payload | None:
        """Read and decode one entry of ``size`` bytes (what the index recorded when it was
        written or found), or ``None`` if the file at ``path`` is not that entry. Nothing is
        read before the name is known to be a regular file of that size (not a FIFO, a device,
        a socket or a symbolic link: opened with ``O_NOFOLLOW | O_NONBLOCK``, never waited on)
        whose header declares exactly that size: a file grown or replaced behind the store's
        back costs one small read to refuse, whatever its size. Then two ``pread`` calls: the
        header, key and meta, then the payload into a ``bytes`` of its own (handed out without
        a copy)."""
        try:
            fd = os.open(path, _READ_FLAGS)
        except OSError as exc:
            if exc.errno in _NOT_AN_ENTRY_ERRNOS:
                return None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                return None
            prefix = os.pread(fd, min(size, HEADER.size + len(key) + MAX_META_BYTES), 0)
            extent = entry_extent(prefix)
            if extent is None or extent[1] != size or extent[0] > len(prefix):
                return None
            head = extent[0]
            body = os.pread(fd, size - head, head)
        finally:
            os.close(fd)
        if len(body) != size - head:
            return None  # the file changed under us: a short entry
        return decode_parts(prefix[:head], body, key)

    def _drop(self, stem: str) -> bool:
        """Remove ``stem`` from the index and the directory (lock held)."""
        size = self._index.pop(stem, None)
        if size is None:
            return False
        self._usage -= size
        self._unlink(str(self._dir / (stem + _SUFFIX)))
        return True

    def _evict_to(self, limit: int) -> None:
        """Evict least recently used entries until usage is at most ``limit`` (lock held)."""
        while self._index and self._usage > limit:
            stem, size = self._index.popitem(last=False)
            self._usage -= size
            self._unlink(str(self._dir / (stem + _SUFFIX)))
            self._stats.evictions += 1

    @staticmethod
    def _unlink(path: str) -> None:
        try:
            os.unlink(path)
        except OSError:
            pass  # already gone; a failed unlink leaves a file the next open re-indexes

    def _fail(self, message: str) -> None:
        with self._lock:
            self._stats.failed_puts += 1
            self._note_error(message)

    def _note_error(self, message: str) -> None:
        self._stats.errors += 1
        self._stats.last_error = message

    def __repr__(self) -> str:
        return (
            f"DiskStore({str(self._dir)!r}, capacity_bytes={self._capacity}, "
            f"entries={len(self._index)}, usage_bytes={self._usage})"
        )
