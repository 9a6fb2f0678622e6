"""The KV-connector paths of pagedkv's vLLM manager (docs/integrations/vllm.md, KV connectors).

What vLLM 0.33's scheduler asks of its KV-cache manager when a KV connector is configured, on
full-attention and sliding-window groups:

- admission with external tokens (``allocate_slots(..., num_external_computed_tokens=e)``): the
  connector's tokens get slots as scheduled tokens of the admission (``add_sequence(...,
  num_scheduled=e + n, num_external_computed_tokens=e)``: a window group's positions out of its
  window at the hit plus ``e`` are released before the admission is sized, never allocated, as
  vLLM skips them), and are indexed at once, as vLLM caches them, for a synchronous load;
- an asynchronous load (``delay_cache_blocks=True``) is admitted with the hashes of the local hit
  only, so nothing it loads is indexed until the scheduler's ``cache_blocks`` after the load
  (the manager gives the other hashes there, with the scheduler's watermark, which a failed load
  rolls back); ``reserved_blocks`` (what other in-flight loads still need) must stay available;
- the blocks an in-flight load still needs (``coordinator.get_num_blocks_to_allocate``, read by
  the scheduler for its reservations; a window group at most its admission cap);
- deferred frees: ``pop_blocks_for_free`` hands the request's blocks over and keeps its
  sequence until the scheduler returns them through ``block_pool.free_blocks``;
- ``remove_skipped_blocks``: the core's window release at the processed watermark
  (``release_skipped_blocks``; nothing in full-attention groups).

Refused by name: an async load on a window group whose watermark then rolls back into positions
the window released at admission (a failed load, or one of the whole prompt, whose last token
the scheduler recomputes): vLLM's tables hold the null block there and the request goes on,
where the core refuses to roll a sequence back past a released position.
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


def require_decoder_groups(manager: KVCacheManager, what: str) -> None:
    """Refuses a connector path on a config with a cross-attention group (vLLM's scheduler
    refuses connectors for encoder-decoder models)."""
    if manager._cross is not None:
        raise UnsupportedVllmFeatureError(f"{what} with cross-attention groups (encoder-decoder models)")


def _skipped_blocks(window: int, processed: int, block_size: int) -> int:
    """Leading blocks a window of ``window`` tokens puts out at ``processed`` tokens (vLLM's
    ``get_num_skipped_tokens(processed) // block_size``)."""
    return max(processed - (window - 1), 0) // block_size


def admitted_blocks(manager: KVCacheManager, seq_id: int, hit: int, num_external: int) -> Any:
    """The blocks vLLM's admission with external tokens returns on a config with a window
    group: per group from ``admitted_blocks_from`` on (vLLM's ``KVCacheBlocks``)."""
    blocks = manager._blocks
    groups = tuple(
        [blocks[b] for b in manager._core.block_table(seq_id, group=g)[start:].tolist()]
        for g, start in enumerate(admitted_blocks_from(manager, hit, num_external))
    )
    return manager.create_kv_cache_blocks(groups)


def admitted_blocks_from(manager: KVCacheManager, hit: int, num_external: int) -> list[int]:
    """Per group, the first table position of the blocks vLLM's admission returns (those of
    ``allocate_new_blocks``): after the hit and the external tokens, except in a window group
    whose window keeps none of the external tokens (a window of one token), where vLLM
    allocated no external block and the first new block is the one after the skipped ones."""
    bs = manager.block_size
    total = hit + num_external
    starts = []
    for window in manager.capacity.windows:
        if window is None or num_external == 0 or min(total, window - 1) > 0:
            starts.append(cdiv(total, bs))
        else:
            starts.append(max(_skipped_blocks(window, total, bs), hit // bs))
    return starts


def release_skipped(manager: KVCacheManager, request_id: str, processed_computed_tokens: int) -> None:
    """vLLM's ``remove_skipped_blocks``: each window group releases what its window at the
    processed watermark leaves (the core's window release); nothing without a window group."""
    require_decoder_groups(manager, "remove_skipped_blocks (a KV connector's path)")
    if processed_computed_tokens < 0:
        raise InvalidArgumentError(f"negative processed_computed_tokens ({processed_computed_tokens})")
    state = manager._reqs.get(request_id)
    if state is None or manager.full_attention_only:
        return
    # With a window group no advance is deferred (records.py): the core's watermark is the
    # scheduler's, which bounds what it may release.
    manager._core.release_skipped_blocks(state[0], processed_computed_tokens)


def check_window_rollback(manager: KVCacheManager, seq_id: int, watermark: int) -> None:
    """Refuses (by name) a watermark that rolls a request back into positions a window group
    released at its admission: see the module doc."""
    if manager.full_attention_only:
        return
    bs = manager.block_size
    for g, window in enumerate(manager.capacity.windows):
        if window is None:
            continue
        table = manager._core.block_table(seq_id, group=g).tolist()
        released = next((i for i, b in enumerate(table) if b != 0), len(table))
        if released > _skipped_blocks(window, watermark, bs):
            raise UnsupportedVllmFeatureError(
                f"an async KV load on a sliding-window group (group {g}) rolled back to "
                f"{watermark} computed tokens, into positions its window released at admission "
                "(a failed load, or a load of the whole prompt): vLLM reads the null block there"
            )


def check_external_admission(
    manager: KVCacheManager,
    num_external_computed_tokens: int,
    delay_cache_blocks: bool,
    reserved_blocks: int,
    room: int,
) -> None:
    """What an admission with a connector's tokens needs here; the unsupported part named.
    ``room``: the request's tokens after its local hit (external tokens past them are a
    caller's error, never slots)."""
    require_decoder_groups(manager, "a KV connector's external tokens / async loads")
    if reserved_blocks < 0 or num_external_computed_tokens < 0:
        raise InvalidArgumentError(
            f"negative external tokens ({num_external_computed_tokens}) or reserved blocks "
            f"({reserved_blocks})"
        )
    if num_external_computed_tokens > room:
        raise InvalidArgumentError(
            f"{num_external_computed_tokens} external tokens, more than the {room} tokens after the hit"
        )
    if delay_cache_blocks and num_external_computed_tokens == 0:
        raise InvalidArgumentError("delay_cache_blocks without external tokens (nothing to load)")


def release_before_refusal(manager: KVCacheManager, request: Any, state: list[int]) -> None:
    """vLLM's ``allocate_slots`` of a running request releases what each window leaves at the
    processed watermark (computed less in-flight tokens) before it counts blocks, so a refused
    request keeps them released; the core's own refusal does the same, this is for the
    manager's refusals before the core call (a window group only)."""
    processed = max(request.num_computed_tokens - request.num_in_flight_tokens, 0)
    # (At most the core's watermark: the core refuses a release past it.)
    manager._core.release_skipped_blocks(state[0], min(processed, state[6]))


def short_of_watermark(manager: KVCacheManager, request: Any, state: list[int], positions: int) -> bool:
    """Whether growing a waiting request that holds blocks (its async load finished) from its
    table length to ``positions`` table positions leaves less than the watermark free: vLLM
    applies its watermark to every waiting request's ``allocate_slots``, the core only at
    admission. Every group grows its table alike (vLLM: ``cdiv(slots) - len(req_blocks)``,
    released positions counted). With a window group the release vLLM runs first
    (``release_before_refusal``) is run before the blocks are counted again."""
    require_decoder_groups(manager, "the watermark for a request resuming after a KV load")
    needed = max(positions - state[1], 0) * manager.num_kv_cache_groups + manager.watermark_blocks
    if needed <= manager.block_pool.get_num_free_blocks():
        return False
    if manager.full_attention_only:
        return True
    release_before_refusal(manager, request, state)
    return needed > manager.block_pool.get_num_free_blocks()


def num_blocks_to_allocate(
    manager: KVCacheManager,
    request_id: str,
    num_tokens: int,
    total_computed_tokens: int = 0,
    apply_admission_cap: bool = False,
) -> int:
    """vLLM's ``coordinator.get_num_blocks_to_allocate`` for a request without new hits, as the
    scheduler asks it (the blocks an in-flight load still needs for ``num_tokens`` slots): per
    group, the slots' blocks (a window group at most its admission cap when asked) less those
    its table has, released positions included; a request without blocks less what the window
    at ``total_computed_tokens`` skips; a Mamba group at most one block."""
    require_decoder_groups(manager, "the blocks in-flight KV loads still need")
    bs = manager.block_size
    state = manager._reqs.get(request_id)
    required = cdiv(min(num_tokens, manager.max_model_len), bs)
    if manager.full_attention_only:
        table_len = 0 if state is None else state[1]
        return max(required - table_len, 0) * manager.num_kv_cache_groups
    capacity = manager.capacity
    total = 0
    for window, is_state in zip(capacity.windows, capacity.states, strict=True):
        group_required = required
        held = 0 if state is None else state[1]
        if is_state:
            # vLLM's MambaManager (align mode, no speculative or checkpoint blocks, refused at
            # construction): the table's missing positions, at most the one state block a
            # step allocates (the others are null); a table already as long counts what it
            # holds beyond (vLLM returns the negative difference too).
            missing = required - held
            total += min(missing, 1)
            continue
        if window is not None:
            if apply_admission_cap:
                group_required = min(required, capacity.admission_cap_blocks(window))
            if state is None:
                held = _skipped_blocks(window, total_computed_tokens, bs)
        total += max(group_required - held, 0)
    return total


def give_held_hashes(
    manager: KVCacheManager,
    request: Any,
    state: list[int],
    num_computed_tokens: int,
    loaded: bool,
    max_hashes: int | None = None,
) -> None:
    """Gives the core the hashes an admission held back (an async load's, once it finished; a
    capped hit's, right after the admission), as far as its token ids are known, with the
    computed watermark ``num_computed_tokens``: the blocks full, computed and known below it
    enter the index, as vLLM's ``cache_blocks`` caches them. A load (``loaded``) that covered
    the whole prompt stops one token short: the scheduler recomputes the last token (to
    sample), and the core never rolls a sequence back into indexed blocks; its block is indexed
    when computed. ``max_hashes``: the most hashes the request may have given (a drafter's
    re-prefillable tokens stay uncached, draft.py)."""
    bs = manager.block_size
    watermark = min(num_computed_tokens, request.num_tokens - 1) if loaded else num_computed_tokens
    seq_id, num_hashes = state[0], state[3]
    if loaded:
        check_window_rollback(manager, seq_id, watermark)
    all_hashes = request.block_hashes
    hashes_end = min(len(all_hashes), state[2] // bs)
    if max_hashes is not None and max_hashes < hashes_end:
        hashes_end = max_hashes
    new_hashes = all_hashes[num_hashes:hashes_end]
    # The core computes no token it has no id of (slots allocated past the known tokens are
    # not computed there): its watermark stops at the ids, the scheduler's may run past them.
    core_watermark = watermark if watermark <= state[2] else state[2]
    manager._core.provide_token_ids(seq_id, [], num_computed_tokens=core_watermark, block_hashes=new_hashes)
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
        manager._events.collect(request, state[4])


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
            require_decoder_groups(manager, "deferred frees (pop_blocks_for_free)")
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
        """Frees the popped sequence holding exactly ``blocks`` in vLLM's order for them (the
        last group's first, each tail first)."""
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
        # vLLM frees the popped list (group after group) reversed in one call: the last
        # group's cached blocks join the eviction order first, unlike its plain free.
        manager._free_seq(seq_id, request, last_group_first=True)
