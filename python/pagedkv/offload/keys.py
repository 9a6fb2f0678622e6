"""Store keys: a block's chained hash plus its salt (tenant, extra key) and, for a quantized
cache, its ``kv_cache_dtype``, as one byte string.

The prefix index hashes a full block to a 128-bit integer (``BlockHash = u128`` in
``rust/pagedkv/src/prefix/hash.rs``; ``take_events()`` hands them out as Python ``int``). The
hash already chains the extra key, but a store is shared (a disk directory, a Redis server), so
the salt is also written into the key itself: two tenants can never address each other's
entries, whatever their hashes are.

A quantized block's payload is a row of bytes (codes and scales, docs/quantized_kv.md): an int8
and an fp8 block of one geometry are byte strings of one length, so nothing in the entry tells
them apart. The dtype is therefore part of the key (key version 2): a block is only ever served
to a cache of the dtype that wrote it. Unquantized blocks keep the version-1 key (unchanged, so
stored entries stay valid). The name in the key also carries the block format's revision where
it changed (``_KEY_DTYPE_NAMES``): the 8-bit blocks' scale byte became UE5M3 (it was E8M0), so
an 8-bit block an earlier build stored is never served to this one.
"""

from __future__ import annotations

import operator
import struct

from pagedkv.attention.kv_cache_dtype import KV_CACHE_DTYPES
from pagedkv.errors import InvalidArgumentError, InvalidArgumentTypeError

__all__ = ["HASH_BYTES", "MAX_EXTRA_KEY_BYTES", "check_kv_cache_dtype", "encode_key", "hash_to_int"]

HASH_BYTES = 16
"""Width of a block hash: XXH3-128."""

MAX_EXTRA_KEY_BYTES = 4096
"""A salt longer than this is a caller mistake, not a tenant name (keys stay small in Redis)."""

_KEY_VERSION = 1
_KEY_VERSION_DTYPE = 2
# The dtype's name in a key, where its block format changed since key version 2 began: the 8-bit
# scale byte (E8M0 -> UE5M3, docs/quantized_kv.md). A changed format needs a new name here.
_KEY_DTYPE_NAMES = {"int8": "int8.ue5m3", "fp8_e4m3": "fp8_e4m3.ue5m3"}


def hash_to_int(block_hash: object) -> int:
    """A block hash as the prefix index exposes it (an ``int`` in ``[0, 2**128)``, or its 16
    little-endian bytes, as Rust's ``u128::to_le_bytes``) normalized to an ``int``."""
    if isinstance(block_hash, (bytes, bytearray, memoryview)):
        raw = bytes(block_hash)
        if len(raw) != HASH_BYTES:
            raise InvalidArgumentError(f"a block hash given as bytes has {HASH_BYTES} bytes, got {len(raw)}")
        return int.from_bytes(raw, "little")
    if isinstance(block_hash, bool):
        raise InvalidArgumentTypeError("a block hash is an int or 16 bytes, not a bool")
    try:
        value = operator.index(block_hash)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgumentTypeError(
            f"a block hash is an int or 16 bytes, not {type(block_hash).__name__}"
        ) from None
    if not 0 <= value < 1 << (8 * HASH_BYTES):
        raise InvalidArgumentError(f"a block hash is in [0, 2**128), got {value}")
    return value


def _extra_key_bytes(extra_key: object) -> bytes:
    if extra_key is None:
        return b""
    if isinstance(extra_key, str):
        try:
            raw = extra_key.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate: no UTF-8 for it
            raise InvalidArgumentError(f"an extra key (salt) is valid Unicode text ({exc.reason})") from None
    elif isinstance(extra_key, (bytes, bytearray, memoryview)):
        raw = bytes(extra_key)
    else:
        raise InvalidArgumentTypeError(
            f"an extra key (salt) is bytes, str or None, not {type(extra_key).__name__}"
        )
    if len(raw) > MAX_EXTRA_KEY_BYTES:
        raise InvalidArgumentError(
            f"an extra key (salt) has at most {MAX_EXTRA_KEY_BYTES} bytes, got {len(raw)}"
        )
    return raw


def check_kv_cache_dtype(kv_cache_dtype: object) -> str | None:
    """``kv_cache_dtype`` as a key part: None (an unquantized cache's key) or one of
    ``pagedkv.attention.KV_CACHE_DTYPES``."""
    if kv_cache_dtype is None:
        return None
    if not isinstance(kv_cache_dtype, str):
        raise InvalidArgumentTypeError(
            f"kv_cache_dtype is a str or None, not {type(kv_cache_dtype).__name__}"
        )
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise InvalidArgumentError(
            f"kv_cache_dtype must be one of {KV_CACHE_DTYPES} or None, got {kv_cache_dtype!r}"
        )
    return kv_cache_dtype


def encode_key(block_hash: object, extra_key: object = None, kv_cache_dtype: object = None) -> bytes:
    """The store key. Without a dtype: version (1 byte, 1) | hash (16 bytes LE) | salt tag (u32
    LE: 0 no salt, else length + 1) | salt bytes. With ``kv_cache_dtype``: version 2, and the
    dtype's name (u8 length, ASCII) between the hash and the salt tag. The tag keeps ``None``
    and ``b""`` apart, and the length prefixes keep every (hash, dtype, salt) encoding
    distinct."""
    value = hash_to_int(block_hash)
    dtype = check_kv_cache_dtype(kv_cache_dtype)
    salt = _extra_key_bytes(extra_key)
    tag = 0 if extra_key is None else len(salt) + 1
    head = bytes((_KEY_VERSION if dtype is None else _KEY_VERSION_DTYPE,)) + value.to_bytes(
        HASH_BYTES, "little"
    )
    if dtype is not None:
        name = _KEY_DTYPE_NAMES.get(dtype, dtype)
        head += bytes((len(name),)) + name.encode("ascii")
    return head + struct.pack("<I", tag) + salt
