"""EngineConfig: the pool, the scheduler's knobs and the reservation policy of one engine.

Every field is checked when the config is made (``InvalidArgumentError`` naming the field), so that
an engine built from it can always make progress: a knob of zero, an unknown policy string or a
block count the allocator refuses never reaches the scheduler. The checks that need the model
(``max_model_len`` against a contiguous reservation, the K/V memory) are made by ``LLMEngine``.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any, Literal

from pagedkv.engine.kv_budget import check_engine_kv_cache_dtype
from pagedkv.errors import InvalidArgumentError, InvalidArgumentTypeError

__all__ = [
    "MAX_NUM_BLOCKS",
    "MAX_NUM_SLOTS",
    "MAX_SPECULATIVE_NGRAM",
    "KV_ROLES",
    "OFFLOAD_POLICIES",
    "PREEMPTION_MODES",
    "RESERVATIONS",
    "SCHEDULING_POLICIES",
    "EngineConfig",
    "peer_address",
]

PREEMPTION_MODES = ("recompute", "swap")
RESERVATIONS = ("paged", "contiguous")
OFFLOAD_POLICIES = ("compute", "evict")
SCHEDULING_POLICIES = ("fcfs", "lpm", "dfs")
KV_ROLES = ("prefill", "decode")
MAX_NUM_BLOCKS = 1 << 24  # the allocator's limit: block ids fit in 24 bits
MAX_NUM_SLOTS = 2**31 - 1  # num_blocks * block_size: every slot index fits the int32 tables
# Drafts per pass: past a few dozen the acceptance of prompt-lookup drafts is nil (vLLM caps its
# num_speculative_tokens likewise); the bound keeps a typo from allocating a huge verify row.
MAX_SPECULATIVE_NGRAM = 64


@dataclass(frozen=True)
class EngineConfig:
    # The device pool, in blocks; None (the default) sizes it by ``kv_cache_bytes``. An engine
    # holds the resolved config: ``num_blocks`` set, ``kv_cache_bytes`` None.
    num_blocks: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_host_blocks: int = 0
    preemption: Literal["recompute", "swap"] = "recompute"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 256  # rows per forward pass (decode rows + prefill chunks)
    enable_chunked_prefill: bool = True
    # "paged": blocks on demand. "contiguous": also admit only while every running sequence can
    # reserve max_model_len slots (the contiguous-reservation baseline on the same KV memory).
    reservation: Literal["paged", "contiguous"] = "paged"
    max_model_len: int | None = None  # default: the model's context length
    # Free blocks an admission must leave for the running sequences' next appends (default: 1% of
    # the pool), so that admitting does not force an immediate preemption.
    admission_watermark_blocks: int | None = None
    # Prompt-lookup speculative decoding: up to this many draft tokens per greedy decoding
    # sequence and pass, from n-gram matches in its own context (0: off).
    speculative_ngram: int = 0
    # The host cache: evicted prefix blocks keep their K/V in this many host blocks and come
    # back as hits (docs/offload.md). 0: none, unless ``offload`` is given: then as many as the
    # device pool (the field holds the size in effect once the config is made).
    num_host_cache_blocks: int = 0
    # The store (a pagedkv.offload DiskStore, RedisStore) below the host cache: written
    # through, read on admission after the device and host-cache hits.
    offload: object | None = None
    # How long an admission waits for the store's blocks at most; later ones are misses. None:
    # follow the store's measured latency (engine/store_lookup.py, docs/offload.md).
    offload_deadline_s: float | None = None
    # When a block goes to the store: "compute" once the pass that computed it has run (replicas
    # sharing the store see a prefix at once; eviction still writes a block the queue dropped),
    # "evict" only when the host cache takes it from the device (docs/offload.md).
    offload_policy: Literal["compute", "evict"] = "compute"
    # Hybrid KV groups (engine/kv_layout.py): a model with sliding-window layers (Gemma 3) keeps
    # one block table per group of layers, and the sliding-window groups release the blocks
    # their window has passed (vLLM's hybrid KV-cache manager). False: one full-attention group
    # of every layer (vLLM's --disable-hybrid-kv-cache-manager): the window still applies in
    # attention, so the tokens are the same, but every layer keeps its whole history. No effect
    # on a model without sliding-window layers. A block's bytes depend on the layout (its group
    # holds fewer layers when hybrid): num_blocks counts blocks, not bytes.
    hybrid_kv: bool = True
    # The K/V cache's storage (engine/kv_budget.py, docs/quantized_kv.md): None is the fp32
    # cache; "float16" / "bfloat16" a 16-bit one; "int8" / "fp8_e4m3" 8-bit codes with a scale
    # byte per (token, head); "int4" KIVI-style codes with each running sequence's open block in
    # an int8 residual slot (max_num_seqs slots, outside the pool). A block of a quantized
    # cache costs fewer bytes: num_blocks still counts blocks.
    kv_cache_dtype: str | None = None
    # The order in which waiting requests are admitted (docs/scheduling.md): "fcfs" first come,
    # first served; "lpm" the request the prefix cache would serve most of now; "dfs" requests
    # sharing a prefix together, depth first over their block chains. Requests preempted by
    # recompute come back first under every policy, unless that breaks the aging bound.
    scheduling: Literal["fcfs", "lpm", "dfs"] = "fcfs"
    # lpm/dfs: no waiting request is passed over by more than this many admissions (0: the same
    # order as fcfs).
    aging_bound: int = 2048
    # Disaggregated serving (docs/transfer.md, The engine): "prefill" computes prompts and hands
    # their K/V out over NIXL (its listener at kv_peer, "host:port"; default an ephemeral port on
    # 127.0.0.1); "decode" reads them in before generating (kv_peer: the one prefill instance it
    # reads from, "host:port"; default any the requests' params name). None: a single instance.
    kv_role: Literal["prefill", "decode"] | None = None
    kv_peer: str | None = None
    # The device pool's K/V bytes (engine/kv_budget.py counts a block's codes, scales and an
    # int4 cache's residual slots): the engine makes it as many blocks as the bytes hold. None
    # with num_blocks None: room for DEFAULT_FULL_CONTEXTS sequences at the model's full
    # context (kv_budget.default_kv_cache_bytes). Give num_blocks or kv_cache_bytes, not both.
    kv_cache_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.num_blocks is not None:
            _integer("num_blocks", self.num_blocks, 1, MAX_NUM_BLOCKS)
        if self.kv_cache_bytes is not None:
            _integer("kv_cache_bytes", self.kv_cache_bytes, 1, None)
            if self.num_blocks is not None:
                raise InvalidArgumentError(
                    "EngineConfig: give num_blocks or kv_cache_bytes, not both "
                    f"(num_blocks={self.num_blocks}, kv_cache_bytes={self.kv_cache_bytes})"
                )
        _integer("block_size", self.block_size, 1, MAX_NUM_SLOTS)
        _integer("num_host_blocks", self.num_host_blocks, 0, MAX_NUM_BLOCKS)
        _integer("num_host_cache_blocks", self.num_host_cache_blocks, 0, MAX_NUM_BLOCKS)
        for name, blocks in (
            ("num_blocks", self.num_blocks or 0),
            ("num_host_blocks", self.num_host_blocks),
            ("num_host_cache_blocks", self.num_host_cache_blocks),
        ):
            if blocks * self.block_size > MAX_NUM_SLOTS:
                raise InvalidArgumentError(
                    f"EngineConfig: {name} * block_size = {blocks * self.block_size} exceeds the "
                    f"{MAX_NUM_SLOTS} token slots a pool may have"
                )
        _integer("max_num_seqs", self.max_num_seqs, 1, None)
        _integer("max_num_batched_tokens", self.max_num_batched_tokens, 1, None)
        _integer("speculative_ngram", self.speculative_ngram, 0, MAX_SPECULATIVE_NGRAM)
        if self.max_model_len is not None:
            # A prompt of one token and one generated token.
            _integer("max_model_len", self.max_model_len, 2, None)
        if self.admission_watermark_blocks is not None:
            # It applies only while some sequence runs, so even the whole pool lets the first in.
            _integer(
                "admission_watermark_blocks",
                self.admission_watermark_blocks,
                0,
                MAX_NUM_BLOCKS if self.num_blocks is None else self.num_blocks,
            )
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "hybrid_kv"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgumentError(f"EngineConfig.{name} must be a bool, got {getattr(self, name)!r}")
        check_engine_kv_cache_dtype(self.kv_cache_dtype)
        _choice("preemption", self.preemption, PREEMPTION_MODES)
        _choice("reservation", self.reservation, RESERVATIONS)
        _choice("offload_policy", self.offload_policy, OFFLOAD_POLICIES)
        _choice("scheduling", self.scheduling, SCHEDULING_POLICIES)
        _integer("aging_bound", self.aging_bound, 0, 2**63 - 1)
        if self.scheduling != "fcfs" and not self.enable_prefix_caching:
            raise InvalidArgumentError(
                f"EngineConfig: scheduling={self.scheduling!r} orders by the prefix cache; it needs "
                "enable_prefix_caching"
            )
        if self.offload is not None:
            from pagedkv.offload.store import BlockStore  # only with a store: needs the offload extra

            if not isinstance(self.offload, BlockStore):
                raise InvalidArgumentTypeError(
                    f"EngineConfig.offload must be a pagedkv.offload store, got {type(self.offload).__name__}"
                )
        deadline = self.offload_deadline_s
        if deadline is not None and (
            isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not 0 <= deadline <= 60
        ):
            raise InvalidArgumentError(
                "EngineConfig.offload_deadline_s must be None (adaptive) or in [0, 60] seconds, "
                f"got {deadline!r}"
            )
        if self.num_host_cache_blocks == 0 and self.offload is not None and self.num_blocks is not None:
            # Sized by bytes: set when the engine resolves num_blocks (replace() runs this again).
            object.__setattr__(self, "num_host_cache_blocks", self.num_blocks)
        if (self.num_host_cache_blocks or self.offload is not None) and not self.enable_prefix_caching:
            raise InvalidArgumentError(
                "EngineConfig: the host cache and the store need enable_prefix_caching"
            )
        if self.kv_role is not None:
            _choice("kv_role", self.kv_role, KV_ROLES)
        if self.kv_peer is not None:
            if self.kv_role is None:
                raise InvalidArgumentError("EngineConfig: kv_peer needs a kv_role")
            peer_address(self.kv_peer)
        if self.preemption == "swap" and self.num_host_blocks == 0:
            raise InvalidArgumentError("EngineConfig: preemption='swap' needs num_host_blocks > 0")

    @property
    def pool_blocks(self) -> int:
        """``num_blocks`` once the engine has sized the pool (InvalidArgumentError before: a
        config sized by bytes needs the model to count its blocks)."""
        if self.num_blocks is None:
            raise InvalidArgumentError(
                "EngineConfig: the pool is sized by kv_cache_bytes; LLMEngine resolves num_blocks"
            )
        return self.num_blocks

    @property
    def cache_dtype(self) -> str:
        """``kv_cache_dtype`` with the default resolved (``"float32"``)."""
        return check_engine_kv_cache_dtype(self.kv_cache_dtype)

    @property
    def offload_blocks(self) -> int:
        """Deprecated: ``num_host_cache_blocks`` (the size in effect)."""
        warnings.warn(
            "EngineConfig.offload_blocks is deprecated: use num_host_cache_blocks",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.num_host_cache_blocks


def peer_address(peer: object) -> tuple[str, int]:
    """``"host:port"`` as (host, port); ``InvalidArgumentError`` unless the host is a non-empty
    printable ASCII name of at most 253 characters and the port in [0, 65535]."""
    if not isinstance(peer, str) or peer.count(":") != 1:
        raise InvalidArgumentError(f"EngineConfig.kv_peer must be 'host:port', got {peer!r}")
    host, port = peer.split(":")
    if not host or len(host) > 253 or not host.isascii() or not host.isprintable() or " " in host:
        raise InvalidArgumentError(f"EngineConfig.kv_peer's host must be a printable name, got {host!r}")
    if not port.isdigit() or not port.isascii() or len(port) > 5 or int(port) > 65535:
        raise InvalidArgumentError(f"EngineConfig.kv_peer's port must be in [0, 65535], got {port!r}")
    return host, int(port)


def _integer(name: str, value: object, low: int, high: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"EngineConfig.{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise InvalidArgumentError(f"EngineConfig.{name} must be {bound}, got {value}")


def _choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise InvalidArgumentError(f"EngineConfig.{name} must be one of {', '.join(choices)}; got {value!r}")


def _num_offload_blocks(config: EngineConfig) -> int:
    """Deprecated: ``num_host_cache_blocks``."""
    warnings.warn(
        "EngineConfig.num_offload_blocks is deprecated: use num_host_cache_blocks",
        DeprecationWarning,
        stacklevel=2,
    )
    return config.num_host_cache_blocks


def _accept_num_offload_blocks(init: Any) -> Any:
    """The generated ``__init__``, also taking ``num_offload_blocks``, the deprecated keyword of
    ``num_host_cache_blocks`` (a ``DeprecationWarning``; both given must agree). Not a field:
    ``dataclasses.replace`` and ``repr`` know one name."""

    @functools.wraps(init)
    def __init__(self: EngineConfig, *args: Any, num_offload_blocks: Any = None, **kwargs: Any) -> None:
        if num_offload_blocks is not None:
            warnings.warn(
                "EngineConfig(num_offload_blocks=...) is deprecated: use num_host_cache_blocks",
                DeprecationWarning,
                stacklevel=2,
            )
            given = kwargs.setdefault("num_host_cache_blocks", num_offload_blocks)
            if given is not num_offload_blocks and given != num_offload_blocks:
                raise InvalidArgumentError(
                    f"EngineConfig: num_host_cache_blocks={given!r} disagrees with "
                    f"num_offload_blocks={num_offload_blocks!r} (its deprecated name)"
                )
        init(self, *args, **kwargs)

    return __init__


setattr(EngineConfig, "__init__", _accept_num_offload_blocks(EngineConfig.__init__))  # noqa: B010
setattr(EngineConfig, "num_offload_blocks", property(_num_offload_blocks))  # noqa: B010
