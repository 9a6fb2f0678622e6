"""The cross-attention groups of encoder-decoder models (Whisper) in pagedkv's vLLM manager
(docs/integrations/vllm.md, Cross-attention).

vLLM gives each request with encoder inputs, at its admission, ``ceil(encoder tokens / block
size)`` blocks in every ``CrossAttentionSpec`` group (its ``CrossAttentionManager``), from the
pool the decoder's self-attention groups allocate from: never prefix-cached, never grown, freed
with the request. The admission's check counts them with the decoder's blocks and the watermark:
``decoder + encoder + watermark <= free``, refused as a whole.

Here they are a second ``pagedkv.KvCacheManager`` on the decoder core's ``BlockPool`` (no
prefix caching, one full-attention group per cross-attention group, one sequence per request
with encoder inputs, under the decoder sequence's id). Both cores then read one free list, so
the decoder core's free count, usage and watermark see the encoder blocks. An admission with
encoder tokens checks vLLM's sum first (no core call when it is short), then takes the encoder
blocks and admits the decoder sequence: with the encoder blocks already off the free list, the
decoder core's own checks are vLLM's sums again, so a refusal there is a disagreement
(``InvariantViolation``, after giving the encoder blocks back). Requests without encoder inputs
hold no encoder sequence (vLLM gives them zero cross-attention blocks).

Supported with full-attention decoder groups and prefix caching off only (vLLM's engine turns
prefix caching off for encoder-decoder models; its own prefix look-up raises on a
cross-attention group); KV connectors are refused (vLLM's scheduler refuses them for
encoder-decoder models).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.single_type_kv_cache_manager import CrossAttentionManager
from vllm.v1.kv_cache_interface import CrossAttentionSpec, KVCacheConfig
from vllm.v1.request import Request, RequestStatus

import pagedkv
from pagedkv.errors import (
    InvalidArgumentError,
    InvariantViolation,
    OutOfBlocksError,
    UnsupportedVllmFeatureError,
)
from pagedkv.integrations.vllm.capacity import cdiv
from pagedkv.integrations.vllm.views import GroupView, RequestBlocks

# The manager (manager.py) is typed ``Any`` here: manager.py imports this module, and the
# package's layering forbids import cycles, typing-only ones included (tests/python/test_layering.py).
KVCacheManager = Any


def cross_group_ids(kv_cache_config: KVCacheConfig) -> list[int]:
    """vLLM's indices of the config's cross-attention groups (exact class)."""
    return [
        i
        for i, g in enumerate(kv_cache_config.kv_cache_groups)
        if type(g.kv_cache_spec) is CrossAttentionSpec
    ]


def shared_pool(
    kv_cache_config: KVCacheConfig,
    num_blocks: int,
    block_size: int,
    enable_caching: bool,
    kv_groups: list[Any],
) -> pagedkv.BlockPool | None:
    """The pool the decoder core must be built on when the config has cross-attention groups
    (None: it has none), or the unsupported combination named."""
    if not cross_group_ids(kv_cache_config):
        return None
    if enable_caching:
        raise UnsupportedVllmFeatureError(
            "prefix caching with cross-attention groups (vLLM turns it off for encoder-decoder "
            "models; set enable_prefix_caching=False)"
        )
    if not all(isinstance(g, pagedkv.FullAttention) for g in kv_groups):
        raise UnsupportedVllmFeatureError(
            "cross-attention groups beside sliding-window groups (pagedkv's vLLM manager supports "
            "them with full-attention decoder groups)"
        )
    return pagedkv.BlockPool(num_blocks, block_size)


class CrossRequestBlocks(Mapping[str, list[KVCacheBlock]]):
    """``req_to_blocks`` of a cross-attention group: request id -> its encoder blocks there
    (empty for a request without encoder inputs, as vLLM's map holds an empty list for it)."""

    def __init__(self, manager: KVCacheManager, cross: EncoderBlocks, index: int) -> None:
        self._manager = manager
        self._cross = cross
        self._index = index

    def __getitem__(self, request_id: str) -> list[KVCacheBlock]:
        seq_id = self._manager._reqs[request_id][0]
        blocks = self._manager._blocks
        return [blocks[b] for b in self._cross.table(seq_id, self._index)]

    def __iter__(self) -> Iterator[str]:
        return iter(self._manager._reqs)

    def __len__(self) -> int:
        return len(self._manager._reqs)


class CrossGroupView(GroupView, CrossAttentionManager):
    """What the scheduler and vLLM's tests read of a cross-attention group's manager.

    An instance of vLLM's ``CrossAttentionManager`` (tests find the group by that class) whose
    constructor never runs: every attribute is ``GroupView``'s (block size, spec, the pool view)
    or a view of pagedkv's state (``req_to_blocks`` reads the encoder core's tables). vLLM's
    methods it inherits are not this manager's API: pagedkv's ``KVCacheManager`` answers every
    call the scheduler makes, and nothing calls them on its coordinator."""

    def __init__(self, manager: KVCacheManager, cross: EncoderBlocks, group_id: int, index: int) -> None:
        spec = manager.kv_cache_config.kv_cache_groups[group_id].kv_cache_spec
        GroupView.__init__(self, manager, group_id, spec)
        self.req_to_blocks = CrossRequestBlocks(manager, cross, index)  # type: ignore[assignment]
        # Never prefix-cached: vLLM's map stays empty for this group.
        self.num_cached_block = MappingProxyType({})  # type: ignore[assignment]


class EncoderBlocks:
    """The encoder blocks of every request, in a second core on the decoder core's pool (see
    the module doc)."""

    def __init__(self, manager: KVCacheManager, pool: pagedkv.BlockPool, group_ids: list[int]) -> None:
        config = manager.kv_cache_config
        self.group_ids = group_ids
        self.num_groups = len(group_ids)
        # Per vLLM group: (is cross-attention, its group in the core that holds it).
        layout: list[tuple[bool, int]] = []
        decoder = 0
        for i in range(len(config.kv_cache_groups)):
            if i in group_ids:
                layout.append((True, group_ids.index(i)))
            else:
                layout.append((False, decoder))
                decoder += 1
        self.layout = layout
        self.core = pagedkv.KvCacheManager(
            pool=pool,
            kv_groups=[pagedkv.FullAttention() for _ in group_ids],
            record_new_block_ids=manager._record_new_block_ids,
        )
        # Decoder sequence id -> encoder blocks per cross-attention group (requests with
        # encoder inputs only).
        self.blocks_per_group: dict[int, int] = {}

    def group_views(self, manager: KVCacheManager) -> list[GroupView]:
        """The coordinator's per-group views: decoder groups read the decoder core's group,
        cross-attention groups the encoder core's."""
        views: list[GroupView] = []
        for i, (is_cross, index) in enumerate(self.layout):
            spec = manager.kv_cache_config.kv_cache_groups[i].kv_cache_spec
            if is_cross:
                views.append(CrossGroupView(manager, self, i, index))
            else:
                view = GroupView(manager, i, spec)
                view.req_to_blocks = RequestBlocks(manager, index)
                views.append(view)
        return views

    def table(self, seq_id: int, index: int) -> list[int]:
        """The encoder block ids of a decoder sequence in cross-attention group ``index``."""
        if seq_id not in self.blocks_per_group:
            return []
        return [int(b) for b in self.core.block_table(seq_id, group=index)]

    def admit(
        self,
        manager: KVCacheManager,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        num_lookahead_tokens: int,
        num_encoder_tokens: int,
        full_sequence_must_fit: bool,
        has_scheduled_reqs: bool,
    ) -> KVCacheBlocks | None:
        """vLLM's admission with encoder tokens: None when the decoder's blocks, the encoder's
        and the watermark pass the free blocks (nothing changed), else the new blocks of every
        group (the encoder's whole)."""
        if num_encoder_tokens < 0:
            raise InvalidArgumentError(f"num_encoder_tokens must be non-negative, got {num_encoder_tokens}")
        if request.request_id in manager._reqs:
            raise UnsupportedVllmFeatureError(
                "encoder tokens for a request that already holds blocks (vLLM's scheduler gives "
                "them at admission only)"
            )
        bs = manager.block_size
        decoder_groups = manager.capacity.num_groups
        encoder = cdiv(num_encoder_tokens, bs) * self.num_groups
        watermark = 0
        if has_scheduled_reqs and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            watermark = manager.watermark_blocks
        free = manager._core.num_free_blocks
        # vLLM's two checks (no hit without prefix caching, nothing computed yet): the whole
        # sequence when it must fit, then the scheduled chunk with its lookahead.
        if full_sequence_must_fit:
            full = cdiv(min(request.num_tokens, manager.max_model_len), bs) * decoder_groups
            if full + encoder + watermark > free:
                return None
        chunk_end = min(
            num_new_computed_tokens + num_new_tokens + num_lookahead_tokens, manager.max_model_len
        )
        if cdiv(chunk_end, bs) * decoder_groups + encoder + watermark > free:
            return None
        seq_id = manager._next_seq_id
        try:
            self.core.add_sequence(seq_id, num_tokens=num_encoder_tokens)
        except OutOfBlocksError as e:
            raise InvariantViolation(
                f"request {request.request_id!r}: {encoder} encoder blocks refused with {free} free"
            ) from e
        self.blocks_per_group[seq_id] = encoder // self.num_groups
        try:
            blocks = manager._admit(
                request,
                num_new_tokens,
                num_new_computed_tokens,
                num_lookahead_tokens,
                full_sequence_must_fit,
                has_scheduled_reqs,
            )
        except BaseException:
            self.free(seq_id)
            raise
        if blocks is None:
            self.free(seq_id)
            raise InvariantViolation(
                f"request {request.request_id!r}: the decoder core refused an admission that "
                "fits vLLM's count with the encoder blocks"
            )
        return blocks

    def blocks_of(self, manager: KVCacheManager, seq_id: int, start: int) -> KVCacheBlocks:
        """The request's blocks from decoder table position ``start`` on, every vLLM group; a
        cross-attention group's whole from position 0 (admission, ``get_blocks``), none after
        (a running step adds no encoder block)."""
        block = manager._blocks.__getitem__
        table = manager._core.block_table
        groups = tuple(
            (list(map(block, self.table(seq_id, index))) if start == 0 else [])
            if is_cross
            else list(map(block, table(seq_id, group=index)[start:].tolist()))
            for is_cross, index in self.layout
        )
        return KVCacheBlocks(groups) if any(groups) else manager.empty_kv_cache_blocks

    def block_ids(self, manager: KVCacheManager, seq_id: int) -> tuple[list[int], ...]:
        """The request's block ids per vLLM group."""
        table = manager._core.block_table
        return tuple(
            self.table(seq_id, index) if is_cross else table(seq_id, group=index).tolist()
            for is_cross, index in self.layout
        )

    def clip(self, block_ids: tuple[list[int], ...], num_blocks: int) -> tuple[list[int], ...]:
        """``get_block_ids_for_computed_tokens``: the decoder groups' first ``num_blocks``, the
        cross-attention groups' whole (vLLM clips attention groups but these)."""
        return tuple(
            ids if is_cross else ids[:num_blocks]
            for ids, (is_cross, _) in zip(block_ids, self.layout, strict=True)
        )

    def free(self, seq_id: int) -> None:
        """Frees the encoder blocks of a decoder sequence (none without encoder inputs)."""
        if self.blocks_per_group.pop(seq_id, None) is not None:
            self.core.free(seq_id)

    def take_new_block_ids(self) -> list[int]:
        """Encoder blocks allocated since the last call (zeroing, when the config asks)."""
        _seqs, _groups, _positions, block_ids, fresh = self.core.take_new_block_ids()
        return [int(b) for b in block_ids[fresh]]

    def check(self, manager: KVCacheManager) -> None:
        """The encoder core's invariants; every encoder sequence a live request's, of
        ``ceil(encoder tokens / block size)`` blocks per group; and the pool's blocks all
        accounted for: free, a decoder table's or an encoder table's, never two
        (``InvariantViolation`` if one does not hold)."""
        self.core.check_invariants()
        live = {state[0] for state in manager._reqs.values()}
        if self.core.num_sequences != len(self.blocks_per_group):
            raise InvariantViolation(
                f"the encoder core holds {self.core.num_sequences} sequences, "
                f"the manager records {len(self.blocks_per_group)}"
            )
        held: set[int] = set()
        for seq_id, per_group in self.blocks_per_group.items():
            if seq_id not in live:
                raise InvariantViolation(f"encoder blocks of sequence {seq_id}, which no request holds")
            for index in range(self.num_groups):
                ids = self.table(seq_id, index)
                if len(ids) != per_group or 0 in ids or held.intersection(ids):
                    raise InvariantViolation(f"sequence {seq_id} cross-attention group {index}: table {ids}")
                held.update(ids)
        decoder: set[int] = set()
        for seq_id in live:
            for is_cross, index in self.layout:
                if not is_cross:
                    decoder.update(
                        b for b in manager._core.block_table(seq_id, group=index).tolist() if b != 0
                    )
        if held & decoder:
            raise InvariantViolation(f"blocks in a decoder and an encoder table: {sorted(held & decoder)}")
        free = manager._core.num_free_blocks
        if free + len(held) + len(decoder) != manager.capacity.usable_blocks:
            raise InvariantViolation(
                f"pool: {free} free + {len(decoder)} decoder + {len(held)} encoder blocks, "
                f"{manager.capacity.usable_blocks} usable"
            )
