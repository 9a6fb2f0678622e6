"""The entry codec: one stored block as a self-checking byte string, the same on disk and in
Redis.

Layout (little-endian), header then three variable parts::

    magic  b"PKVO" | version u16 | kind u8 (0 bytes, 1 array) | ndim u8
    | key_len u32 | meta_len u32 | payload_len u64 | checksum u64
    | key | meta (array only: dtype string, then ndim u64 dims) | payload

``checksum`` is XXH3-64 over the header (its checksum field zeroed), the key, the meta and the
payload. A decoder serves an entry only if the magic and version match, the lengths add up to
exactly the bytes it has, the checksum matches and the key is the key it asked for: a torn
write (a crash mid-file), a flipped byte, a truncated value or a file from another key each
decode to ``None``, a miss. XXH3 rather than CRC-32: ``zlib.crc32`` checks many times slower
than XXH3-64 (benches/results/2026-12-06-comment-numbers.md), and the check is on every load.
"""

from __future__ import annotations

import struct
from typing import TypeAlias

import numpy as np
import xxhash

from pagedkv.errors import InvalidArgumentError, InvalidArgumentTypeError

__all__ = [
    "HEADER",
    "MAX_META_BYTES",
    "MAGIC",
    "VERSION",
    "Payload",
    "check_payload",
    "decode_entry",
    "decode_parts",
    "encode_entry",
    "entry_extent",
    "entry_size",
]

MAGIC = b"PKVO"
VERSION = 1
HEADER = struct.Struct("<4sHBBIIQQ")
_CHECKSUM_OFFSET = HEADER.size - 8
_KIND_BYTES = 0
_KIND_ARRAY = 1
_MAX_NDIM = 16
MAX_META_BYTES = 1 + 255 + 8 * _MAX_NDIM
"""The most meta bytes an entry has: dtype string length (u8), the string, ``ndim`` dims."""
# Plain numeric dtypes only: an object array is pointers, not data.
_ARRAY_KINDS = "biufc"

Payload: TypeAlias = bytes | np.ndarray
"""What a store holds for a block: raw bytes, or a NumPy array (dtype and shape kept)."""


def _checksum(parts: list[memoryview | bytes]) -> int:
    h = xxhash.xxh3_64()
    for part in parts:
        h.update(part)
    return h.intdigest()


def check_payload(payload: object) -> None:
    """Raise the typed error ``encode_entry`` would raise for ``payload``, without encoding it
    (cheap: a caller validates on its own thread and encodes on a worker's)."""
    if isinstance(payload, np.ma.MaskedArray):
        # Only its data would be stored, and the mask silently lost: refused, as prompts are.
        raise InvalidArgumentTypeError("a stored array is not a masked array: its mask would be lost")
    if isinstance(payload, np.ndarray):
        if payload.dtype.kind not in _ARRAY_KINDS or payload.dtype.fields is not None:
            raise InvalidArgumentTypeError(f"a stored array has a plain numeric dtype, not {payload.dtype}")
        if payload.ndim > _MAX_NDIM:
            raise InvalidArgumentError(f"a stored array has at most {_MAX_NDIM} dimensions")
    elif isinstance(payload, memoryview):
        if not payload.c_contiguous:
            raise InvalidArgumentError("a stored memoryview is C-contiguous")
    elif not isinstance(payload, (bytes, bytearray)):
        raise InvalidArgumentTypeError(
            f"a block payload is bytes or a NumPy array, not {type(payload).__name__}"
        )


def encode_entry(key: bytes, payload: object) -> list[bytes | memoryview]:
    """The entry for ``payload`` under ``key`` as a list of buffers (header + key + meta, then
    the payload itself, not copied: a writer writes them in order)."""
    check_payload(payload)
    if isinstance(payload, np.ndarray):
        # A subclass (np.matrix, np.memmap) as the plain array over the same memory, whose
        # ``.data`` is a memoryview; not np.ascontiguousarray: it turns a 0-d array into a 1-d one.
        array = payload.view(np.ndarray)
        if not array.flags.c_contiguous:
            array = array.copy(order="C")
        dtype = array.dtype.str.encode("ascii")
        meta = struct.pack("<B", len(dtype)) + dtype + struct.pack(f"<{array.ndim}Q", *array.shape)
        body: bytes | memoryview = array.data.cast("B") if array.size else b""
        kind, ndim = _KIND_ARRAY, array.ndim
    else:
        assert isinstance(payload, (bytes, bytearray, memoryview))  # check_payload
        body = payload if isinstance(payload, bytes) else memoryview(payload).cast("B")
        meta, kind, ndim = b"", _KIND_BYTES, 0
    body_len = len(body) if isinstance(body, bytes) else body.nbytes
    header = HEADER.pack(MAGIC, VERSION, kind, ndim, len(key), len(meta), body_len, 0)
    checksum = _checksum([header, key, meta, body])
    header = header[:_CHECKSUM_OFFSET] + struct.pack("<Q", checksum)
    return [header + key + meta, body]


def entry_size(parts: list[bytes | memoryview]) -> int:
    """Total bytes of an encoded entry."""
    return sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)


def entry_extent(prefix: bytes | bytearray | memoryview) -> tuple[int, int] | None:
    """From an entry's first ``HEADER.size`` bytes, the size of its head (header, key and meta:
    everything before the payload) and of the whole entry the header declares, or ``None`` if
    they are not a header. A reader of a file compares the whole with the file's size before it
    reads anything more, then reads the head, then the payload on its own (``decode_parts``: no
    copy of it)."""
    if len(prefix) < HEADER.size:
        return None
    magic, version, _, _, key_len, meta_len, body_len, _ = HEADER.unpack_from(prefix)
    if magic != MAGIC or version != VERSION:
        return None
    head = int(HEADER.size + key_len + meta_len)
    return head, head + int(body_len)


def decode_entry(data: bytes | bytearray | memoryview, key: bytes) -> Payload | None:
    """The payload stored in ``data`` for ``key``, or ``None`` if ``data`` is not a whole,
    intact entry for that key (see ``decode_parts``)."""
    view = memoryview(data).cast("B")
    extent = entry_extent(view)
    if extent is None or extent[1] != view.nbytes:
        return None
    head = extent[0]
    return decode_parts(view[:head], view[head:], key)


def decode_parts(
    head: bytes | bytearray | memoryview, body: bytes | bytearray | memoryview, key: bytes
) -> Payload | None:
    """The payload of the entry whose head (header, key, meta) is ``head`` and whose payload
    bytes are ``body``, or ``None`` unless it is whole, intact and stored under ``key``. A
    ``bytes`` payload is ``body`` itself when ``body`` is ``bytes`` (else a copy); an array is a
    view of ``body`` (read-only when ``body`` is ``bytes``: a loader copies it to the device
    anyway)."""
    view = memoryview(head).cast("B")
    body_view = memoryview(body).cast("B")
    if view.nbytes < HEADER.size:
        return None
    magic, version, kind, ndim, key_len, meta_len, body_len, checksum = HEADER.unpack_from(view)
    if magic != MAGIC or version != VERSION or kind not in (_KIND_BYTES, _KIND_ARRAY):
        return None
    key_end = HEADER.size + key_len
    meta_end = key_end + meta_len
    if meta_end != view.nbytes or body_len != body_view.nbytes or ndim > _MAX_NDIM:
        return None
    if view[HEADER.size : key_end] != key:
        return None
    header = bytes(view[:_CHECKSUM_OFFSET]) + b"\0" * 8
    if _checksum([header, view[HEADER.size :], body_view]) != checksum:
        return None
    if kind == _KIND_BYTES:
        return body if isinstance(body, bytes) else bytes(body_view)
    meta = bytes(view[key_end:meta_end])
    try:
        dtype_len = meta[0]
        dtype = np.dtype(meta[1 : 1 + dtype_len].decode("ascii"))
        shape = struct.unpack(f"<{ndim}Q", meta[1 + dtype_len :])
        if dtype.kind not in _ARRAY_KINDS or dtype.fields is not None:
            return None
        return np.frombuffer(body_view, dtype=dtype).reshape(shape)
    except (IndexError, ValueError, TypeError, struct.error, UnicodeDecodeError):
        return None  # a checksummed entry with bad meta: written by something else
