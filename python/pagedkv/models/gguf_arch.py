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

from pagedkv.models.errors import ModelLoadError

__all__ = ["gguf_architecture"]

# GGUF value types -> struct format of one scalar (8 = string, 9 = array are variable-sized).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_MAX_KEYS_SCANNED = 256
_MAX_STRING_BYTES = 1 << 30


def _read(handle: BinaryIO, fmt: str) -> int:
    size = struct.calcsize(fmt)
    data = handle.read(size)
    if len(data) != size:
        raise ModelLoadError("the GGUF header is truncated")
    return struct.unpack("<" + fmt, data)[0]


def _string(handle: BinaryIO) -> bytes:
    n = _read(handle, "Q")
    if n > _MAX_STRING_BYTES:
        raise ModelLoadError(f"a GGUF string of {n} bytes: the file is corrupt")
    data = handle.read(n)
    if len(data) != n:
        raise ModelLoadError("the GGUF header is truncated")
    return data


def _skip_value(handle: BinaryIO, kind: int) -> None:
    if kind in _SCALARS:
        handle.seek(struct.calcsize(_SCALARS[kind]), os.SEEK_CUR)
    elif kind == _STRING:
        _string(handle)
    elif kind == _ARRAY:
        elem, count = _read(handle, "I"), _read(handle, "Q")
        if elem in _SCALARS:
            handle.seek(struct.calcsize(_SCALARS[elem]) * count, os.SEEK_CUR)
        else:
            for _ in range(count):
                _skip_value(handle, elem)
    else:
        raise ModelLoadError(f"unknown GGUF value type {kind}: the file is corrupt")


def gguf_architecture(path: str | os.PathLike[str]) -> str:
    """``general.architecture`` of a GGUF file; ModelLoadError for a missing, non-GGUF or
    truncated file, or one without the key among its first key/value pairs."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"model file not found: {str(path)!r}")
    with path.open("rb") as handle:
        if handle.read(4) != b"GGUF":
            raise ModelLoadError(f"{str(path)!r} is not a GGUF file (no GGUF magic)")
        version = _read(handle, "I")
        if version < 2:
            raise ModelLoadError(f"{str(path)!r} is GGUF version {version}; versions 2 and 3 are read")
        _read(handle, "Q")  # tensor count
        num_keys = _read(handle, "Q")
        for _ in range(min(num_keys, _MAX_KEYS_SCANNED)):
            key = _string(handle)
            kind = _read(handle, "I")
            if key == b"general.architecture":
                if kind != _STRING:
                    raise ModelLoadError("general.architecture is not a string")
                return _string(handle).decode("utf-8", errors="replace")
            _skip_value(handle, kind)
    raise ModelLoadError(f"{str(path)!r} names no general.architecture")
