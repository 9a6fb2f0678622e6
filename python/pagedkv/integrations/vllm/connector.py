"""The KV-connector paths of pagedkv's vLLM manager (docs/integrations/vllm.md, KV connectors).

What vLLM 0.33's scheduler asks of its KV-cache manager when a KV connector is configured, on
full-attention groups:

- admission with external tokens (``allocate_slots(..., num_external_computed_tokens=e)``): the
  connector's tokens get slots as scheduled tokens of the admission (``add_sequence(...,
  num_scheduled=e + n)``), and are indexed at once, as vLLM caches them, for a synchronous load;
- an asynchronous load (``delay_cache_blocks=True``) is admitted with the hashes of the local hit
  only, so nothing it loads is indexed until the scheduler's ``cache_blocks`` after the load
  (the manager gives the other hashes there, with the scheduler's watermark, which a failed load
  rolls back); ``reserved_blocks`` (what other in-flight loads still need) must stay available;
- the blocks an in-flight load still needs (``coordinator.get_num_blocks_to_allocate``, read by
  the scheduler for its reservations);
- deferred frees: ``pop_blocks_for_free`` hands the request's blocks over and keeps its
  sequence until the scheduler returns them through ``block_pool.free_blocks``;
- ``remove_skipped_blocks``: nothing to release in full-attention groups.

Sliding-window groups are refused on these paths: vLLM gives an external hit's out-of-window
positions the null block at admission, where the core would allocate them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm.v1.core.kv_cache_utils import KVCacheBlock

from pagedkv.errors import InvalidArgumentError, InvariantViolation, UnsupportedVllmFeatureError
from pagedkv.integrations.vllm import records
from pagedkv.integrations.vllm.capacity import cdiv

# The manager (manager.py) is typed ``Any`` here: manager.py imports this module, and the
# package's layering forbids import cycles, typing-only ones included (tests/python/test_layering.py).
KVCacheManager = Any


def require_full_attention(manager: KVCacheManager, what: str) -> None:
    """Refuses a connector path on a config with a sliding-window group (see the module doc)
    or a cross-attention group (vLLM's scheduler refuses connectors for encoder-decoder models)."""
    if manager._cross is not None:
        raise UnsupportedVllmFeatureError(f"{what} with cross-attention groups (encoder-decoder models)")
    if not manager.full_attention_only:
        raise UnsupportedVllmFeatureError(
            f"{what} with sliding-window groups (pagedkv's vLLM manager supports KV connectors "
            "on full-attention groups only)"
        )


def check_external_admission(
    manager: KVCacheManager,
    num_external_computed_tokens: int,
    delay_cache_blocks: bool,
    reserved_blocks: int,
    skip_zeroing_group_ids: tuple[int, ...],
) -> None:
    """What an admission with a connector's tokens needs here; the unsupported part named."""
    require_full_attention(manager, "a KV connector's external tokens / async loads")
    if reserved_blocks < 0 or num_external_computed_tokens < 0:
        raise InvalidArgumentError(
            f"negative external tokens ({num_external_computed_tokens}) or reserved blocks "
            f"({reserved_blocks})"
        )
    if skip_zeroing_group_ids and manager._record_new_block_ids:
        # The core logs every new block for zeroing; an async load writes these concurrently.
        raise UnsupportedVllmFeatureError(
            "KV-cache zeroing (needs_kv_cache_zeroing) of blocks an async KV load writes"
        )
    if delay_cache_blocks and num_external_computed_tokens == 0:
        raise InvalidArgumentError("delay_cache_blocks without external tokens (nothing to load)")


def short_of_watermark(manager: KVCacheManager, old_len: int, positions: int) -> bool:
    """Whether growing a waiting request that holds blocks (its async load finished) from
    ``old_len`` to ``positions`` table positions leaves less than the watermark free: vLLM
    applies its watermark to every waiting request's ``allocate_slots``, the core only at
    admission. Full-attention groups only (KV connectors are refused with windows)."""
    require_full_attention(manager, "the watermark for a request resuming after a KV load")
    needed = max(positions - old_len, 0) * manager.num_kv_cache_groups
    return needed + manager.watermark_blocks > manager.block_pool.get_num_free_blocks()


def num_blocks_to_allocate(manager: KVCacheManager, request_id: str, num_tokens: int) -> int:
    """vLLM's ``coordinator.get_num_blocks_to_allocate`` for a request without new hits, as the
    scheduler asks it (the blocks an in-flight load still needs for ``num_tokens`` slots): per
    full-attention group, the slots' blocks less those its table has."""
    require_full_attention(manager, "the blocks in-flight KV loads still need")
    state = manager._reqs.get(request_id)
    table_len = 0 if state is None else state[1]
    per_group = max(cdiv(min(num_tokens, manager.max_model_len), manager.block_size) - table_len, 0)
    return per_group * manager.num_kv_cache_groups


def give_held_hashes(
    manager: KVCacheManager, request: Any, state: list[int], num_computed_tokens: int, loaded: bool
) -> None:
    """Gives the core the hashes an admission held back (an async load's, once it finished; a
    capped hit's, right after the admission), as far as its token ids are known, with the
    computed watermark ``num_computed_tokens``: the blocks full, computed and known below it
    enter the index, as vLLM's ``cache_blocks`` caches them. A load (``loaded``) that covered
    the whole prompt stops one token short: the scheduler recomputes the last token (to
    sample), and the core never rolls a sequence back into indexed blocks; its block is indexed
    when computed."""
    bs = manager.block_size
    watermark = min(num_computed_tokens, request.num_tokens - 1) if loaded else num_computed_tokens
    seq_id, num_hashes = state[0], state[3]
    all_hashes = request.block_hashes
    new_hashes = all_hashes[num_hashes : min(len(all_hashes), state[2] // bs)]
    manager._core.provide_token_ids(seq_id, [], num_computed_tokens=watermark, block_hashes=new_hashes)
    state[3] = num_hashes + len(new_hashes)
    # No advance is deferred here (the request made no allocate_slots since its admission):
    # the core's watermark is the scheduler's.
    state[5] = state[6] = watermark
    records.set_fence(manager, state)
    if loaded:
        # The request resumes as a waiting one, and vLLM applies its watermark to a waiting
        # request's allocate_slots even when no block is needed: no fast path for that call.
        state[7] = -1
    state[4] = max(state[4], min(watermark, state[3] * bs) // bs * bs)
    if manager._events is not None:
        manager._events.collect(request)


class DeferredFrees:
    """Sequences whose blocks the scheduler took with ``pop_blocks_for_free`` and returns later
    through ``block_pool.free_blocks`` (once no in-flight step writes them): the sequence
    stays in the core, holding its blocks, until then."""

    def __init__(self) -> None:
        # Sorted block ids -> (seq id, request) of each popped sequence holding them.
        self._pending: dict[tuple[int, ...], list[tuple[int, Any]]] = {}

    def __len__(self) -> int:
        return sum(len(v) for v in self._pending.values())

    def pop(self, manager: KVCacheManager, request: Any) -> list[KVCacheBlock]:
        """The request's blocks in allocation order (every group, null blocks left out);
        the request is gone from the manager's view, its sequence kept for ``free``."""
        if manager._cross is not None:
            require_full_attention(manager, "deferred frees (pop_blocks_for_free)")
        state = manager._reqs.pop(request.request_id, None)
        manager._held_hashes.pop(request.request_id, None)
        manager._hit_caps.pop(request.request_id, None)
        if state is None:
            return []
        seq_id = state[0]
        ids = [
            b
            for g in range(manager.num_kv_cache_groups)
            for b in manager._core.block_table(seq_id, group=g).tolist()
            if b != 0
        ]
        if not ids:
            # Nothing to hand back: the scheduler frees nothing later, so free it now.
            manager._free_seq(seq_id, request)
            return []
        self._pending.setdefault(tuple(sorted(ids)), []).append((seq_id, request))
        blocks = manager._blocks
        return [blocks[b] for b in ids]

    def free(self, manager: KVCacheManager, blocks: Iterable[KVCacheBlock]) -> None:
        """Frees the popped sequence holding exactly ``blocks`` (tail first, as vLLM)."""
        key = tuple(sorted(b.block_id for b in blocks))
        waiting = self._pending.get(key)
        if not waiting:
            raise InvariantViolation(
                f"block_pool.free_blocks of {len(key)} blocks that no pop_blocks_for_free "
                "handed out (pagedkv's manager frees only a popped request's blocks)"
            )
        # Sequences holding the same blocks are interchangeable: freeing either drops the
        # same references.
        seq_id, request = waiting.pop()
        if not waiting:
            del self._pending[key]
        manager._free_seq(seq_id, request)
