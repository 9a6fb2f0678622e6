"""The architecture a GGUF file names (``general.architecture``), read from its header alone.

``load_model`` dispatches on it before choosing a loader. Parsing a whole file's metadata with the
``gguf`` package reads every tokenizer array (Gemma 3 has 262,144 tokens); the writers put
``general.architecture`` first, so this scan of the key/value section usually stops at key one.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import BinaryIO

from pagedkv.errors import ModelLoadError

__all__ = ["gguf_architecture"]

# GGUF value types -> struct format of one scalar (8 = string, 9 = array are variable-sized).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_MAX_KEYS_SCANNED = 256
_MAX_STRING_BYTES = 1 << 30


_MAX_DEPTH = 4  # nested arrays, as the full reader (gguf_reader) allows


def _remaining(handle: BinaryIO, file_size: int) -> int:
    return file_size - handle.tell()


def _read(handle: BinaryIO, fmt: str) -> int:
    size = struct.calcsize(fmt)
    data = handle.read(size)
    if len(data) != size:
        raise ModelLoadError("the GGUF header is truncated")
    return struct.unpack("<" + fmt, data)[0]


def _string(handle: BinaryIO, file_size: int) -> bytes:
    n = _read(handle, "Q")
    if n > min(_MAX_STRING_BYTES, _remaining(handle, file_size)):  # checked before reading
        raise ModelLoadError(
            f"the GGUF header is truncated or corrupt: a string of {n} bytes runs past the end"
        )
    return handle.read(n)


def _skip(handle: BinaryIO, n_bytes: int, file_size: int) -> None:
    if n_bytes > _remaining(handle, file_size):
        raise ModelLoadError("the GGUF header is truncated or corrupt: a metadata value runs past the end")
    handle.seek(n_bytes, os.SEEK_CUR)


def _skip_value(handle: BinaryIO, kind: int, file_size: int, depth: int = 0) -> None:
    """Skips one value; every size is checked against the bytes left in the file before any
    seek or read (a lying count is an error, never a huge allocation or a loop of 2**62)."""
    if kind in _SCALARS:
        _skip(handle, struct.calcsize(_SCALARS[kind]), file_size)
    elif kind == _STRING:
        _skip(handle, _read(handle, "Q"), file_size)
    elif kind == _ARRAY:
        if depth >= _MAX_DEPTH:
            raise ModelLoadError(f"GGUF arrays nested deeper than {_MAX_DEPTH}: the file is corrupt")
        elem, count = _read(handle, "I"), _read(handle, "Q")
        if elem in _SCALARS:
            _skip(handle, struct.calcsize(_SCALARS[elem]) * count, file_size)
            return
        # A string or an array element takes at least its 8- or 12-byte header.
        if count * 8 > _remaining(handle, file_size):
            raise ModelLoadError(
                f"the GGUF header is truncated or corrupt: an array of {count} elements runs past the end"
            )
        for _ in range(count):
            _skip_value(handle, elem, file_size, depth + 1)
    else:
        raise ModelLoadError(f"unknown GGUF value type {kind}: the file is corrupt")


def gguf_architecture(path: str | os.PathLike[str]) -> str:
    """``general.architecture`` of a GGUF file; ModelLoadError for a missing, non-GGUF or
    truncated file, or one without the key among its first key/value pairs."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"model file not found: {str(path)!r}")
    file_size = path.stat().st_size
    with path.open("rb") as handle:
        if handle.read(4) != b"GGUF":
            raise ModelLoadError(f"{str(path)!r} is not a GGUF file (no GGUF magic)")
        version = _read(handle, "I")
        if version < 2:
            raise ModelLoadError(f"{str(path)!r} is GGUF version {version}; versions 2 and 3 are read")
        _read(handle, "Q")  # tensor count
        num_keys = _read(handle, "Q")
        for _ in range(min(num_keys, _MAX_KEYS_SCANNED)):
            key = _string(handle, file_size)
            kind = _read(handle, "I")
            if key == b"general.architecture":
                if kind != _STRING:
                    raise ModelLoadError("general.architecture is not a string")
                return _string(handle, file_size).decode("utf-8", errors="replace")
            _skip_value(handle, kind, file_size)
    raise ModelLoadError(f"{str(path)!r} names no general.architecture")
