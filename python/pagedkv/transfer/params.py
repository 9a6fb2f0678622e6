"""``KvTransferParams``: what a prefill instance hands out for one request, and the decode
instance reads its blocks with (vLLM's ``kv_transfer_params``, docs/transfer.md, The protocol).

The wire form (``to_dict`` / ``from_dict``) is a JSON-safe dict with vLLM's key names where vLLM
has one (``remote_engine_id``, ``remote_request_id``, ``remote_block_ids``, ``remote_host``,
``remote_port``, ``remote_num_tokens``) and pagedkv's own beside them: the per-block checksums,
the instance (which incarnation of the engine holds the blocks), the block size, where the
handshake page lies and the lease. The dict crosses a proxy or a router, so ``from_dict``
trusts nothing: every field is type- and range-checked and a malformed dict is an
``InvalidArgumentError`` naming the key, never a crash further down.

Block ids per KV group: ``block_ids[g]`` are the prefill side's blocks of group ``g`` for the
request's *last* ``len(block_ids[g])`` logical blocks (a full-attention group sends them all, a
sliding-window group only those its window still sees), so group ``g``'s list starts at logical
position ``first_position(g) = ceil(num_tokens / block_size) - len(block_ids[g])``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.errors import InvalidArgumentError

__all__ = ["KvTransferParams", "MAX_BLOCKS_PER_REQUEST", "MAX_LAYOUT_BYTES", "TRANSFER_VERSION"]

TRANSFER_VERSION = 1
"""Bumped on any change to the params, the handshake page or the notifications."""
MAX_BLOCKS_PER_REQUEST = 1 << 20
"""The most blocks one request's params may name over all groups (bounds what a hostile dict
can make the decode side allocate)."""
MAX_LAYOUT_BYTES = 1 << 20
"""The largest handshake page the decode side reads."""
_MAX_ID_CHARS = 256
_MAX_BLOCK_ID = (1 << 31) - 1
_MAX_U64 = (1 << 64) - 1


def _int(value: object, key: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"kv_transfer_params[{key!r}] must be an int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise InvalidArgumentError(f"kv_transfer_params[{key!r}] must be in [{lo}, {hi}], got {value}")
    return value


def _text(value: object, key: str) -> str:
    if not isinstance(value, str) or not value or len(value) > _MAX_ID_CHARS:
        raise InvalidArgumentError(
            f"kv_transfer_params[{key!r}] must be a non-empty string of at most {_MAX_ID_CHARS} characters"
        )
    return value


def _groups(value: object, key: str, hi: int) -> tuple[tuple[int, ...], ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise InvalidArgumentError(
            f"kv_transfer_params[{key!r}] must be a non-empty list of lists, one per KV group"
        )
    groups = []
    for g, ids in enumerate(value):
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise InvalidArgumentError(f"kv_transfer_params[{key!r}][{g}] must be a list of ints")
        groups.append(tuple(_int(i, f"{key}[{g}]", 0, hi) for i in ids))
    return tuple(groups)


@dataclass(frozen=True)
class KvTransferParams:
    """One request's blocks on a prefill instance, and how to reach them.

    engine_id: the prefill engine's name; instance: its incarnation (a restart gets a new one, so
    a decode side never reads a dead incarnation's stale handshake); request_id: the prefill
    side's id of the request; host, port: where its NIXL listener serves agent metadata;
    num_tokens: the tokens whose KV the blocks hold; block_size: tokens per block;
    block_ids / checksums: per KV group, the blocks (see the module docstring for their
    positions) and the XXH3-64 of each block's bytes over every cache region
    (``pagedkv.transfer.checksum``); layout_addr, layout_nbytes: the handshake page (the
    prefill's cache layout, read once per peer); lease_s: how long the prefill side holds the
    blocks without a renewal; staged_addr, staged_nbytes: where a block-major copy of the
    blocks lies (all groups in order, one row of ``staged_nbytes / num_blocks`` bytes each), or
    0, 0 (``pagedkv.transfer.staging``).
    """

    engine_id: str
    instance: str
    request_id: str
    host: str
    port: int
    num_tokens: int
    block_size: int
    block_ids: tuple[tuple[int, ...], ...]
    checksums: tuple[tuple[int, ...], ...]
    layout_addr: int
    layout_nbytes: int
    lease_s: float
    staged_addr: int = 0
    staged_nbytes: int = 0

    def __post_init__(self) -> None:
        for key in ("engine_id", "instance", "request_id", "host"):
            _text(getattr(self, key), key)
        _int(self.port, "port", 1, 65535)
        _int(self.num_tokens, "num_tokens", 0, 1 << 40)
        _int(self.block_size, "block_size", 1, 1 << 20)
        _int(self.layout_addr, "layout_addr", 1, _MAX_U64)
        _int(self.layout_nbytes, "layout_nbytes", 1, MAX_LAYOUT_BYTES)
        lease = self.lease_s
        if isinstance(lease, bool) or not isinstance(lease, (int, float)) or not (0 < lease < math.inf):
            raise InvalidArgumentError(
                f"kv_transfer_params['lease_s'] must be a positive number, got {lease!r}"
            )
        object.__setattr__(self, "lease_s", float(lease))
        _int(self.staged_addr, "staged_addr", 0, _MAX_U64)
        _int(self.staged_nbytes, "staged_nbytes", 0, _MAX_U64)
        if (self.staged_addr == 0) != (self.staged_nbytes == 0):
            raise InvalidArgumentError(
                "kv_transfer_params: staged_addr and staged_nbytes are both 0 or both set"
            )
        block_ids = _groups(self.block_ids, "block_ids", _MAX_BLOCK_ID)
        checksums = _groups(self.checksums, "checksums", _MAX_U64)
        object.__setattr__(self, "block_ids", block_ids)
        object.__setattr__(self, "checksums", checksums)
        if [len(g) for g in checksums] != [len(g) for g in block_ids]:
            raise InvalidArgumentError("kv_transfer_params: one checksum per block id in every group")
        total = sum(len(g) for g in block_ids)
        if total > MAX_BLOCKS_PER_REQUEST:
            raise InvalidArgumentError(
                f"kv_transfer_params names {total} blocks, more than {MAX_BLOCKS_PER_REQUEST}"
            )
        if len({b for g in block_ids for b in g}) != total:
            raise InvalidArgumentError("kv_transfer_params: a block id appears twice")
        if self.staged_nbytes and (total == 0 or self.staged_nbytes % total):
            raise InvalidArgumentError("kv_transfer_params: staged_nbytes is not a whole number of blocks")
        for g, ids in enumerate(block_ids):
            if len(ids) > self.num_logical_blocks:
                raise InvalidArgumentError(
                    f"kv_transfer_params: group {g} names {len(ids)} blocks, more than the "
                    f"{self.num_logical_blocks} that {self.num_tokens} tokens fill"
                )

    @property
    def num_groups(self) -> int:
        return len(self.block_ids)

    @property
    def num_logical_blocks(self) -> int:
        """Blocks ``num_tokens`` tokens fill (the last one possibly in part)."""
        return -(-self.num_tokens // self.block_size)

    @property
    def num_blocks(self) -> int:
        """Blocks named over all groups."""
        return sum(len(g) for g in self.block_ids)

    def first_position(self, group: int) -> int:
        """The logical block position of ``block_ids[group][0]``."""
        return self.num_logical_blocks - len(self.block_ids[group])

    @property
    def agent_name(self) -> str:
        """The prefill instance's NIXL agent name: engine and incarnation."""
        return f"{self.engine_id}#{self.instance}"

    def to_dict(self) -> dict[str, Any]:
        """The JSON-safe wire form (vLLM's key names where vLLM has one)."""
        return {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "transfer_version": TRANSFER_VERSION,
            "remote_engine_id": self.engine_id,
            "remote_instance": self.instance,
            "remote_request_id": self.request_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_num_tokens": self.num_tokens,
            "remote_block_size": self.block_size,
            "remote_block_ids": [list(g) for g in self.block_ids],
            "remote_block_checksums": [list(g) for g in self.checksums],
            "remote_layout_addr": self.layout_addr,
            "remote_layout_nbytes": self.layout_nbytes,
            "remote_lease_s": self.lease_s,
            "remote_staged_addr": self.staged_addr,
            "remote_staged_nbytes": self.staged_nbytes,
        }

    @classmethod
    def from_dict(cls, params: Mapping[str, Any]) -> KvTransferParams:
        """Parse and validate the wire form; ``InvalidArgumentError`` names the first bad key.
        Keys it does not know are ignored (a router may add its own)."""
        if not isinstance(params, Mapping):
            raise InvalidArgumentError(f"kv_transfer_params must be a dict, got {type(params).__name__}")
        version = params.get("transfer_version")
        if version != TRANSFER_VERSION:
            raise InvalidArgumentError(
                f"kv_transfer_params['transfer_version'] is {version!r}; pagedkv speaks {TRANSFER_VERSION}"
            )
        fields = {
            "engine_id": "remote_engine_id",
            "instance": "remote_instance",
            "request_id": "remote_request_id",
            "host": "remote_host",
            "port": "remote_port",
            "num_tokens": "remote_num_tokens",
            "block_size": "remote_block_size",
            "block_ids": "remote_block_ids",
            "checksums": "remote_block_checksums",
            "layout_addr": "remote_layout_addr",
            "layout_nbytes": "remote_layout_nbytes",
            "lease_s": "remote_lease_s",
            "staged_addr": "remote_staged_addr",
            "staged_nbytes": "remote_staged_nbytes",
        }
        missing = [key for key in fields.values() if key not in params]
        if missing:
            raise InvalidArgumentError(f"kv_transfer_params lacks {missing}")
        return cls(**{name: params[key] for name, key in fields.items()})
