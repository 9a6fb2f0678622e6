"""Typed access to GGUF metadata: a value of the wrong type or out of range is a ModelLoadError
naming the key, never a ``ValueError`` from ``int("abc")`` or a model with ``block_count=-1``.

GGUF stores every value with its type; a file is free to put a string or a float where the
architecture expects an integer, so each getter checks the Python type the reader produced
(``bool`` is not an integer here, although Python says it is).
"""

from __future__ import annotations

import math
from typing import Any

from pagedkv.errors import ModelLoadError

__all__ = ["get_float", "get_int", "get_str", "require"]

_MISSING: Any = object()


def require(metadata: dict[str, Any], key: str) -> Any:
    if key not in metadata:
        raise ModelLoadError(f"GGUF metadata lacks {key!r}")
    return metadata[key]


def _value(metadata: dict[str, Any], key: str, default: Any) -> Any:
    return require(metadata, key) if default is _MISSING else metadata.get(key, default)


def get_int(
    metadata: dict[str, Any], key: str, default: Any = _MISSING, *, minimum: int = 1, maximum: int = 2**62
) -> int:
    """An integer in [minimum, maximum]; ``default`` (unchecked) when the key is absent."""
    if default is not _MISSING and key not in metadata:
        return int(default)
    value = _value(metadata, key, default)
    if type(value) is not int:
        raise ModelLoadError(
            f"GGUF metadata {key!r} is {value!r} ({type(value).__name__}), expected an integer"
        )
    if not minimum <= value <= maximum:
        raise ModelLoadError(f"GGUF metadata {key!r} is {value}, expected {minimum} to {maximum}")
    return value


def get_float(metadata: dict[str, Any], key: str, default: Any = _MISSING, *, positive: bool = True) -> float:
    """A finite number (integers accepted), > 0 when ``positive``."""
    if default is not _MISSING and key not in metadata:
        return float(default)
    value = _value(metadata, key, default)
    if type(value) not in (int, float) or not math.isfinite(value) or (positive and value <= 0):
        kind = "a positive finite number" if positive else "a finite number"
        raise ModelLoadError(f"GGUF metadata {key!r} is {value!r}, expected {kind}")
    return float(value)


def get_str(metadata: dict[str, Any], key: str, default: Any = _MISSING) -> str:
    value = _value(metadata, key, default)
    if type(value) is not str:
        raise ModelLoadError(
            f"GGUF metadata {key!r} is {value!r} ({type(value).__name__}), expected a string"
        )
    return value
