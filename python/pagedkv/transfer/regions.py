"""``KvRegions``: the cache arrays a transfer moves, as block-indexed rows of bytes, and the
layout both sides compare at the handshake.

A region is one host NumPy array whose first axis is the block id: a K or V cache
``[num_blocks, block_size, num_kv_heads, head_dim]``, or a ``QuantizedKvCache``'s
``data [num_blocks, block_bytes]`` (its bytes move as they are: codes and scales together).
Block ``b`` of any KV group is row ``b`` of *every* region (the engine's hybrid layout shares its
K/V tensors between groups, ``pagedkv.engine.kv_layout``), so moving a block moves that row of
each region, and the decode side must hold the same regions in the same order with the same
row size and dtype (``RemoteLayout.check_matches``); only the number of blocks may differ.

An int4 ``QuantizedKvCache`` keeps the tokens of a sequence's unfilled last block in a residual
slot, not in its block row (docs/quantized_kv.md): only sealed (full) blocks are rows of bytes,
so such regions set ``sealed_blocks_only`` and the prefill side sends whole blocks only.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedkv.attention.quantized_cache import QuantizedKvCache
from pagedkv.errors import InvalidArgumentError, TransferError
from pagedkv.transfer.params import MAX_LAYOUT_BYTES, TRANSFER_VERSION

__all__ = ["KvRegions", "RemoteLayout", "RegionSpec"]

_MAX_REGIONS = 4096
_MAX_DESCRIPTORS = (1 << 31) - 1  # NIXL numbers descriptors with int32


@dataclass(frozen=True)
class RegionSpec:
    """What both sides must agree on for one region: the bytes of one block row, the dtype
    (``numpy.dtype.str``) and the shape of a row."""

    block_nbytes: int
    dtype: str
    row_shape: tuple[int, ...]


class KvRegions:
    """The regions of one instance's caches, in a fixed order (``from_caches``: every K cache,
    then every V cache). Holds references to the arrays: they must outlive any transfer."""

    def __init__(self, arrays: Sequence[np.ndarray | QuantizedKvCache], *, block_size: int) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise InvalidArgumentError(f"block_size must be a positive int, got {block_size!r}")
        if isinstance(arrays, (np.ndarray, QuantizedKvCache)) or not isinstance(arrays, Sequence):
            raise InvalidArgumentError("regions are a list of cache arrays")
        if not 1 <= len(arrays) <= _MAX_REGIONS:
            raise InvalidArgumentError(f"between 1 and {_MAX_REGIONS} regions, got {len(arrays)}")
        rows: list[np.ndarray] = []
        sealed_only = False
        for i, cache in enumerate(arrays):
            if isinstance(cache, QuantizedKvCache):
                if cache.block_size != block_size:
                    raise InvalidArgumentError(
                        f"region {i} has blocks of {cache.block_size} tokens, not {block_size}"
                    )
                sealed_only |= cache.kv_cache_dtype == "int4"
                cache = cache.data
            if not isinstance(cache, np.ndarray):
                raise InvalidArgumentError(
                    f"region {i} is a {type(cache).__name__}; transfer registers host NumPy arrays only"
                )
            if cache.ndim < 2 or not cache.flags.c_contiguous or cache.dtype.hasobject:
                raise InvalidArgumentError(
                    f"region {i} must be a C-contiguous numeric array [num_blocks, ...]"
                )
            if cache.ndim == 4 and cache.shape[1] != block_size:
                raise InvalidArgumentError(
                    f"region {i} has blocks of {cache.shape[1]} tokens, not {block_size}"
                )
            rows.append(cache)
        num_blocks = {int(a.shape[0]) for a in rows}
        if len(num_blocks) != 1 or 0 in num_blocks:
            raise InvalidArgumentError(
                f"every region needs the same, non-zero number of blocks, got {sorted(num_blocks)}"
            )
        if len(rows) * max(num_blocks) > _MAX_DESCRIPTORS:
            raise InvalidArgumentError(
                f"{len(rows)} regions of {max(num_blocks)} blocks exceed {_MAX_DESCRIPTORS} descriptors"
            )
        self.arrays: tuple[np.ndarray, ...] = tuple(rows)
        self.block_size = block_size
        self.num_blocks = num_blocks.pop()
        self.sealed_blocks_only = sealed_only
        self.specs = tuple(
            RegionSpec(int(a[0].nbytes), a.dtype.str, tuple(int(d) for d in a.shape[1:])) for a in rows
        )

    @classmethod
    def from_caches(
        cls,
        k_caches: Sequence[np.ndarray | QuantizedKvCache],
        v_caches: Sequence[np.ndarray | QuantizedKvCache],
        *,
        block_size: int,
    ) -> KvRegions:
        """The regions of per-layer (or per-tensor) K and V caches: K caches first, then V."""
        return cls([*k_caches, *v_caches], block_size=block_size)

    @property
    def block_nbytes(self) -> int:
        """Bytes one block holds over all regions (what one block's transfer moves)."""
        return sum(s.block_nbytes for s in self.specs)

    def check_block_ids(self, block_ids: np.ndarray, what: str) -> None:
        if block_ids.size and (int(block_ids.min()) < 0 or int(block_ids.max()) >= self.num_blocks):
            raise InvalidArgumentError(f"{what} must be block ids in [0, {self.num_blocks})")

    def descriptors(self) -> np.ndarray:
        """uint64 ``[num_regions * num_blocks, 3]`` (address, bytes, device 0): descriptor
        ``r * num_blocks + b`` is block ``b`` of region ``r``."""
        return _descriptors(
            [int(a.ctypes.data) for a in self.arrays], [s.block_nbytes for s in self.specs], self.num_blocks
        )

    def registrations(self) -> list[tuple[int, int, int, str]]:
        """One NIXL DRAM registration per region: (address, bytes, device, label)."""
        return [(int(a.ctypes.data), int(a.nbytes), 0, "") for a in self.arrays]

    def layout_page(self, engine_id: str, instance: str) -> bytes:
        """The handshake page: this layout as the decode side reads it (``RemoteLayout``)."""
        page = json.dumps(
            {
                "version": TRANSFER_VERSION,
                "engine_id": engine_id,
                "instance": instance,
                "block_size": self.block_size,
                "num_blocks": self.num_blocks,
                "regions": [
                    [int(a.ctypes.data), s.block_nbytes, s.dtype, list(s.row_shape)]
                    for a, s in zip(self.arrays, self.specs, strict=True)
                ],
            },
            separators=(",", ":"),
        ).encode()
        if len(page) > MAX_LAYOUT_BYTES:
            raise InvalidArgumentError(f"the layout page is {len(page)} bytes, more than {MAX_LAYOUT_BYTES}")
        return page


def _descriptors(addresses: list[int], block_nbytes: list[int], num_blocks: int) -> np.ndarray:
    base = np.asarray(addresses, dtype=np.uint64)[:, None]
    size = np.asarray(block_nbytes, dtype=np.uint64)[:, None]
    out = np.zeros((len(addresses), num_blocks, 3), dtype=np.uint64)
    out[:, :, 0] = base + size * np.arange(num_blocks, dtype=np.uint64)[None, :]
    out[:, :, 1] = size
    return out.reshape(-1, 3)


@dataclass(frozen=True)
class RemoteLayout:
    """A prefill instance's layout as its handshake page states it."""

    engine_id: str
    instance: str
    block_size: int
    num_blocks: int
    addresses: tuple[int, ...]
    specs: tuple[RegionSpec, ...]

    @classmethod
    def from_page(cls, page: bytes) -> RemoteLayout:
        """Parse a handshake page; anything malformed is a ``TransferError`` (the peer, not the
        caller, sent it)."""
        try:
            doc: Any = json.loads(page.decode())
            if doc["version"] != TRANSFER_VERSION:
                raise TransferError(
                    f"the peer speaks transfer version {doc['version']!r}, not {TRANSFER_VERSION}"
                )
            regions = doc["regions"]
            layout = cls(
                engine_id=str(doc["engine_id"]),
                instance=str(doc["instance"]),
                block_size=_positive(doc["block_size"]),
                num_blocks=_positive(doc["num_blocks"]),
                addresses=tuple(_positive(r[0]) for r in regions),
                specs=tuple(
                    RegionSpec(_positive(r[1]), str(r[2]), tuple(_positive(d) for d in r[3])) for r in regions
                ),
            )
        except TransferError:
            raise
        except (ValueError, KeyError, IndexError, TypeError) as error:  # JSON, shape of the document
            raise TransferError(f"the peer's handshake page is malformed: {error}") from error
        if (
            not 1 <= len(layout.specs) <= _MAX_REGIONS
            or len(layout.specs) * layout.num_blocks > _MAX_DESCRIPTORS
        ):
            raise TransferError(
                f"the peer's handshake page lists {len(layout.specs)} regions of {layout.num_blocks} blocks"
            )
        return layout

    def check_matches(self, local: KvRegions, engine_id: str, instance: str) -> None:
        """``TransferError`` unless this layout can feed ``local`` block for block."""
        if (self.engine_id, self.instance) != (engine_id, instance):
            raise TransferError(
                f"the handshake page is {self.engine_id}#{self.instance}'s, not {engine_id}#{instance}'s"
            )
        if self.block_size != local.block_size:
            raise TransferError(f"the peer's blocks hold {self.block_size} tokens, ours {local.block_size}")
        if len(self.specs) != len(local.specs):
            raise TransferError(f"the peer has {len(self.specs)} cache regions, we have {len(local.specs)}")
        for r, (theirs, ours) in enumerate(zip(self.specs, local.specs, strict=True)):
            if theirs != ours:
                raise TransferError(f"cache region {r} differs: the peer's {theirs}, ours {ours}")

    def descriptors(self) -> np.ndarray:
        """The peer's descriptors, numbered as ``KvRegions.descriptors`` numbers ours."""
        return _descriptors(list(self.addresses), [s.block_nbytes for s in self.specs], self.num_blocks)


def _positive(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 1 << 64:
        raise TransferError(f"the peer's handshake page has {value!r} where a positive int belongs")
    return value
