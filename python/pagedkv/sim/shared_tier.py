"""A KV store shared by every replica of a simulated cluster (`pagedkv.sim.cluster`).

Blocks a replica's prefix cache evicts are written to the shared tier (keyed by the router's
chained block key, `router_index.request_keys`: equal tokens give equal keys on every replica);
the tier is bounded in bytes and evicts its least recently used blocks. A request's prefix is
served first from its replica's own cache, then, for the blocks that follow, from the shared tier:
the loaded tokens are not prefilled, and the load costs ``bytes / bandwidth + latency`` before
the prefill (the way LMCache, Mooncake's store or SGLang's HiCache serve a prefix a GPU lost).
Only evicted blocks are written (no write-through): a block in a replica's cache is not also in
the tier until that replica drops it.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.errors import InvalidArgumentError, InvariantViolation

__all__ = ["SharedTierConfig", "SharedTier", "GBIT_BYTES"]

GBIT_BYTES = 1e9 / 8
"""Bytes in one gigabit (network bandwidths are quoted in Gb/s)."""


@dataclass(frozen=True)
class SharedTierConfig:
    """capacity_bytes: what the tier holds (``None``: unbounded).
    load_gbps: bandwidth of a load, gigabits per second (100: one 100 Gb/s NIC, 12.5 GB/s).
    load_latency_s: fixed cost of one load (a request's whole shared prefix is one load)."""

    capacity_bytes: int | None
    load_gbps: float = 100.0
    load_latency_s: float = 0.001

    def __post_init__(self) -> None:
        if self.capacity_bytes is not None and (
            isinstance(self.capacity_bytes, bool)
            or not isinstance(self.capacity_bytes, int)
            or self.capacity_bytes < 0
        ):
            raise InvalidArgumentError(
                f"shared tier capacity_bytes must be an integer >= 0 or None, got {self.capacity_bytes!r}"
            )
        if not (math.isfinite(self.load_gbps) and self.load_gbps > 0):
            raise InvalidArgumentError(f"shared tier load_gbps must be finite and > 0, got {self.load_gbps}")
        if not (math.isfinite(self.load_latency_s) and self.load_latency_s >= 0):
            raise InvalidArgumentError(
                f"shared tier load_latency_s must be finite and >= 0, got {self.load_latency_s}"
            )

    def load_s(self, num_bytes: int) -> float:
        """Seconds to load ``num_bytes`` (0 for nothing: no load, no latency)."""
        if num_bytes <= 0:
            return 0.0
        return num_bytes / (self.load_gbps * GBIT_BYTES) + self.load_latency_s


class SharedTier:
    """The store's contents: block keys in least-recently-used order, bounded by bytes.

    Every block has ``bytes_per_block`` bytes (a full KV block of the simulated model); a tier
    smaller than one block holds nothing."""

    def __init__(self, config: SharedTierConfig, bytes_per_block: int) -> None:
        if isinstance(bytes_per_block, bool) or not isinstance(bytes_per_block, int) or bytes_per_block < 1:
            raise InvalidArgumentError(f"bytes_per_block must be an integer >= 1, got {bytes_per_block!r}")
        self.config = config
        self.bytes_per_block = bytes_per_block
        self._blocks: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.stored_blocks = 0  # put() calls that wrote a block not already held
        self.evicted_blocks = 0  # blocks dropped to stay within capacity_bytes
        self.loaded_blocks = 0  # blocks served by load()

    @property
    def used_bytes(self) -> int:
        return len(self._blocks) * self.bytes_per_block

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: int) -> bool:
        return key in self._blocks

    def put(self, key: int) -> None:
        """Writes an evicted block (or refreshes it if held), dropping the least recently used
        blocks beyond the capacity."""
        capacity = self.config.capacity_bytes
        if capacity is not None and capacity < self.bytes_per_block:
            return
        if key in self._blocks:
            self._blocks.move_to_end(key)
            return
        self._blocks[key] = None
        self.stored_blocks += 1
        if capacity is not None:
            while len(self._blocks) * self.bytes_per_block > capacity:
                self._blocks.popitem(last=False)
                self.evicted_blocks += 1

    def match(self, keys: Sequence[int]) -> int:
        """How many of ``keys``, from the first, the tier holds (no LRU update)."""
        matched = 0
        for key in keys:
            if key not in self._blocks:
                break
            matched += 1
        return matched

    def load(self, keys: Sequence[int]) -> int:
        """Serves ``keys`` (all held: a ``match``'s prefix), marking them recently used; returns
        the bytes read."""
        for key in keys:
            if key not in self._blocks:
                raise InvalidArgumentError("load of a block the shared tier does not hold")
        for key in keys:
            self._blocks.move_to_end(key)
        self.loaded_blocks += len(keys)
        return len(keys) * self.bytes_per_block

    def serve(
        self, keys: Sequence[int], local_blocks: int, input_tokens: int, block_size: int
    ) -> tuple[int, float]:
        """A request's shared-tier hit after its replica served ``local_blocks`` of ``keys`` (its
        chained full-block keys): loads the blocks that follow, as far as the tier holds them,
        and returns (tokens loaded, load seconds). Like the replica, it leaves the last prompt
        token to compute: a prompt covered to its end on a block boundary loads one block less."""
        shared = self.match(keys[local_blocks:])
        if shared and (local_blocks + shared) * block_size >= input_tokens:
            shared -= 1
        if not shared:
            return 0, 0.0
        num_bytes = self.load(keys[local_blocks : local_blocks + shared])
        return shared * block_size, self.config.load_s(num_bytes)

    def check_invariants(self) -> None:
        capacity = self.config.capacity_bytes
        if capacity is not None and self.used_bytes > capacity:
            raise InvariantViolation(f"shared tier holds {self.used_bytes} bytes > capacity {capacity}")
        if self.stored_blocks - self.evicted_blocks != len(self._blocks):
            raise InvariantViolation("shared tier: stored - evicted != blocks held")
