"""Admission in pagedkv's vLLM manager: the prefix-cache look-up of a waiting request
(``get_computed_blocks``) and the first ``allocate_slots`` of a request without blocks (``admit``:
the core's ``add_sequence`` with the request's own block hashes, vLLM's can-never-fit answers
first).

The functions are the manager's methods (manager.py binds each as a class attribute, so a call
costs what a method defined there costs: ``get_computed_blocks`` runs for every waiting request
every step); ``manager`` is the ``KVCacheManager``.
"""

from __future__ import annotations

import functools
from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.request import Request, RequestStatus

from pagedkv.errors import InvariantViolation, OutOfBlocksError, UnsupportedVllmFeatureError
from pagedkv.integrations.vllm import connector, mamba, records
from pagedkv.integrations.vllm.capacity import cdiv
from pagedkv.integrations.vllm.hit_blocks import hit_blocks

# The manager (manager.py) is typed ``Any`` here: manager.py imports this module, and the
# package's layering forbids import cycles, typing-only ones included (tests/python/test_layering.py).
KVCacheManager = Any

# get_computed_blocks looks up this many blocks first (full attention): a hit shorter than
# them is the answer, a longer one is looked up whole.
_FIRST_LOOKUP_BLOCKS = 16


def get_computed_blocks(
    manager: KVCacheManager, request: Request, max_cache_hit_length: int | None = None
) -> tuple[KVCacheBlocks, int, int]:
    """The prefix-cache hit of a waiting request: (blocks, hit tokens, shared-prefix boundary).

    The hit is pagedkv's look-up with the request's own block hashes, no side effect; the
    blocks are taken at ``allocate_slots`` (as vLLM takes its references there). The returned
    blocks are looked up when first read (hit_blocks.py: the scheduler passes them back and
    reads nothing else of them)."""
    if not manager.prefix_cache_lookup_enabled(request):
        return manager.empty_kv_cache_blocks, 0, 0
    capped = max_cache_hit_length is not None and max_cache_hit_length < request.num_tokens - 1
    if manager._hit_caps:
        manager._hit_caps.pop(request.request_id, None)
    if max_cache_hit_length is None:
        max_cache_hit_length = request.num_tokens - 1
    bs = manager.block_size
    all_hashes, all_tokens = request.block_hashes, request._all_token_ids
    # No hit runs past the pool's blocks, and the core refuses a look-up longer than the pool
    # could hold (an error that would stop vLLM's step, where vLLM answers the hit it has).
    # (Plain comparisons rather than min()/max(), whose argument parsing costs more: this
    # runs for every waiting request every step, refused admissions included.)
    num_blocks = max_cache_hit_length // bs if max_cache_hit_length > 0 else 0
    if len(all_hashes) < num_blocks:
        num_blocks = len(all_hashes)
    if manager.capacity.usable_blocks < num_blocks:
        num_blocks = manager.capacity.usable_blocks
    if num_blocks == 0:
        return manager.empty_kv_cache_blocks, 0, 0
    # Full attention only: the hit is the longest run of cached blocks from the start, so
    # a look-up over the first blocks that stops short of their end is the whole answer.
    # Most look-ups stop early (a waiting request is looked up again every step), and the
    # core reads every hash and id it is given (vLLM's look-up stops at the first miss).
    first = _FIRST_LOOKUP_BLOCKS if manager.full_attention_only else num_blocks
    if first < num_blocks:
        hit = manager._core.match_prefix(all_tokens[: first * bs + 1], block_hashes=all_hashes[:first])
        if hit == first * bs:  # the run may go on: the whole look-up
            hit = manager._core.match_prefix(
                all_tokens[: num_blocks * bs + 1], block_hashes=all_hashes[:num_blocks]
            )
    else:
        hit = manager._core.match_prefix(
            all_tokens[: num_blocks * bs + 1], block_hashes=all_hashes[:num_blocks]
        )
    if capped:
        # Admission must not take the longer hit the cache may hold (connector.py).
        manager._hit_caps[request.request_id] = hit
    boundary = (
        0 if manager.full_attention_only else shared_prefix_boundary(manager, all_hashes[:num_blocks], hit)
    )
    if hit == 0:
        return manager.empty_kv_cache_blocks, 0, boundary
    if manager._events is not None and getattr(request, "kv_cache_report_mode", None) == "full":
        # vLLM reports the blocks of a hit as stored again in this mode (for a gateway).
        manager._events.report_hit(request, hit // manager.block_size, manager.num_kv_cache_groups)
    return hit_blocks(manager, all_hashes, hit), hit, boundary


def shared_prefix_boundary(manager: KVCacheManager, hashes: Any, hit: int) -> int:
    """vLLM's third answer of ``get_computed_blocks`` with several KV groups: the first
    attention group's own hit (full attention's, which vLLM's coordinator looks up first, else
    the first group's) where it runs past the reconciled ``hit``, else 0. vLLM's scheduler
    ends a Mamba group's prefill chunk there (``_mamba_block_aligned_split``, the shared-prefix
    junction), so this is part of the schedule. One group: always 0 (its own hit is the hit)."""
    if manager.capacity.num_groups == 1:
        return 0
    # vLLM's coordinator's own attribute (the first full-attention group; None without one)
    first = manager.coordinator.full_attention_group_id or 0
    own = int(manager._core.group_hits(hashes, len(hashes) * manager.block_size)[first])
    return own if own > hit else 0


def admit(
    manager: KVCacheManager,
    request: Request,
    num_new_tokens: int,
    num_new_computed_tokens: int,
    num_lookahead_tokens: int,
    full_sequence_must_fit: bool,
    has_scheduled_reqs: bool,
    num_external: int = 0,
    delay_cache_blocks: bool = False,
    reserved_blocks: int = 0,
    diverged_hit: bool = False,
    skip_zeroing_group_ids: tuple[int, ...] = (),
) -> KVCacheBlocks | None:
    if request.num_computed_tokens:
        raise UnsupportedVllmFeatureError(
            "admitting a request with computed tokens and no blocks (a KV connector's load)"
        )
    # A sequence that can never fit: vLLM's admission check says so with None (the request
    # keeps waiting), where the core refuses the call itself (InvalidArgumentError) and
    # would stop the scheduler's step. The core's two checks: with the whole-sequence check
    # (scheduler_reserve_full_isl) the prompt's blocks, a window group at most its admission
    # cap; always, the scheduled chunk and its lookahead, a window group less what its
    # release at the hit leaves.
    bs = manager.block_size
    capacity = manager.capacity
    # A connector's tokens count as computed for the window release (the core's
    # num_external_computed_tokens).
    prompt_blocks = capacity.prompt_blocks(request.num_tokens, num_external) if full_sequence_must_fit else 0
    if prompt_blocks > capacity.usable_blocks:
        return None
    chunk_end = num_new_computed_tokens + num_external + num_new_tokens + num_lookahead_tokens
    positions = cdiv(chunk_end if chunk_end < manager.max_model_len else manager.max_model_len, bs)
    if capacity.live_blocks(positions, num_new_computed_tokens + num_external) > capacity.usable_blocks:
        return None
    seq_id = manager._next_seq_id
    watermark = has_scheduled_reqs and request.status in (
        RequestStatus.WAITING,
        RequestStatus.PREEMPTED,
    )
    tokens = request._all_token_ids  # the list behind all_token_ids (a read-only view)
    # A connector's tokens are scheduled tokens of the admission (their slots allocated).
    num_scheduled = num_external + num_new_tokens
    excess = num_new_computed_tokens + num_scheduled - request.num_tokens
    if excess > 0:
        # Slots past the request's tokens (vLLM's own tests schedule a whole prompt on top of
        # its hit; its scheduler never does): vLLM allocates them, the core computes no token
        # it has no id of, so they are lookahead slots there.
        num_scheduled -= excess
        num_lookahead_tokens += excess
    skip = capped = False
    if manager.enable_caching:
        skip = request.skip_reading_prefix_cache
        # A request that must not read the cache is admitted without hashes (no hit), then
        # given them as a hit capped at 0 is: it writes the cache as vLLM's does. An async
        # load's blocks wait for their hashes until it finished (``cache_blocks``).
        capped = (
            bool(manager._hit_caps) and manager._hit_caps.pop(request.request_id, None) is not None
        ) or manager._hold_all_hashes
        if manager.full_attention_only:
            # The core refuses when the admission's new blocks (plus the hit's cached ones
            # it revives, the watermark and the reserved blocks) pass its free and evictable
            # blocks (admit_groups.rs, the plan); it would first convert the whole prompt
            # and its hashes (about 10 us, and about 0.7 admissions a step are refused on
            # a full pool). The same refusals, from lower bounds of what the core counts (the
            # revived blocks left out): with the whole-sequence check, the whole prompt's new
            # blocks and the watermark (admission_requirement); always, the chunk's new blocks,
            # the watermark and the reserved blocks.
            num_hit_blocks = (num_new_computed_tokens // bs) * capacity.num_groups
            fresh = positions * capacity.num_groups - num_hit_blocks
            whole = prompt_blocks - num_hit_blocks if full_sequence_must_fit else 0
            if watermark:
                fresh += manager.watermark_blocks
                whole += manager.watermark_blocks
            available = manager._core.num_free_blocks
            if fresh + reserved_blocks > available or whole > available:
                return None
        if delay_cache_blocks or capped or skip:  # (skip: no hit, no hash)
            hashes = list(request.block_hashes[: num_new_computed_tokens // bs])
        else:
            hashes = list(request.block_hashes)
        add = manager._core.add_sequence
        if diverged_hit:
            # Only here: an unused keyword would cost every other admission its parsing.
            add = functools.partial(add, diverged_hit=True)
        if manager._prefill_checkpoint is not None:
            if num_external:
                raise UnsupportedVllmFeatureError(
                    f"request {request.request_id!r}: a KV connector's tokens on a Mamba group "
                    "with prefill check-points (num_prefill_checkpoint_blocks)"
                )
            add = functools.partial(add, prefill_checkpoint=manager._prefill_checkpoint)
        try:
            hit = add(
                seq_id,
                tokens,
                num_scheduled=num_scheduled,
                reserve_prompt=False,
                require_full_prompt=full_sequence_must_fit,
                num_lookahead_tokens=num_lookahead_tokens,
                block_hashes=hashes,
                apply_watermark=watermark,
                reserved_blocks=reserved_blocks,
                num_external_computed_tokens=num_external,
            )
        except OutOfBlocksError:
            manager._collect_events(request)
            return None
        if manager._state_groups:
            # vLLM counts the hit's blocks (a connector's tokens' too), null ones included, as
            # cached: the admission's store ranges and offers start there (offers noted below).
            manager._states_cached[request.request_id] = mamba.admitted_cached_blocks(hit, num_external, bs)
        num_hashes = len(hashes)
        # The tokens this admission caches (the record's estimate): its events' ranges end there.
        cached = min(hit + num_scheduled, request.num_tokens, num_hashes * bs) // bs * bs
        manager._collect_events(request, cached)
        num_ids = len(tokens)
    else:
        try:
            hit = manager._core.add_sequence(
                seq_id,
                num_tokens=request.num_tokens,
                num_scheduled=num_scheduled,
                reserve_prompt=False,
                require_full_prompt=full_sequence_must_fit,
                num_lookahead_tokens=num_lookahead_tokens,
                apply_watermark=watermark,
                reserved_blocks=reserved_blocks,
                num_external_computed_tokens=num_external,
            )
        except OutOfBlocksError:
            return None
        num_hashes = -1
        num_ids = request.num_tokens
        cached = 0
    manager._next_seq_id += 1
    if hit != num_new_computed_tokens:
        # The scheduler took its hit from get_computed_blocks in this same step; a different
        # one here would schedule tokens over blocks nobody computed.
        manager._core.free(seq_id)
        raise InvariantViolation(
            f"request {request.request_id!r}: pagedkv's hit at admission ({hit} tokens) "
            f"differs from the looked-up one ({num_new_computed_tokens})"
        )
    end = hit + num_scheduled
    table_len = cdiv(min(end + num_lookahead_tokens, manager.max_model_len), bs)
    state = [seq_id, table_len, num_ids, num_hashes, cached, end, end, -1, -1, -1]
    records.set_fence(manager, state)
    manager._reqs[request.request_id] = state
    if manager.enable_caching and (delay_cache_blocks or capped or skip):
        if delay_cache_blocks:
            manager._held_hashes[request.request_id] = True  # until its load finished
        else:
            try:
                manager._give_held_hashes(manager, request, state, end, False)
            except BaseException:
                # Not half-admitted: the sequence and its record go (the error names why).
                del manager._reqs[request.request_id]
                manager._core.free(seq_id)
                raise
            records.set_quick_fences(manager, state)  # the hashes it gave
    if skip_zeroing_group_ids and num_external and manager._record_new_block_ids:
        # vLLM leaves the external tokens' blocks of these groups out of its zeroing list (an
        # async load writes them after this step: zeroing would race it); per_step.py drops
        # them from the core's new-block log.
        manager._unzeroed.append(
            (seq_id, tuple(skip_zeroing_group_ids), hit // bs, cdiv(hit + num_external, bs))
        )
    if manager._state_groups:  # from the record set above (a Mamba group needs caching on)
        mamba.note_cached_states(manager, request.request_id, state)
    # The blocks of the tokens to compute (vLLM returns neither the hit's nor the
    # connector's).
    if num_external and not manager.full_attention_only:
        return connector.admitted_blocks(manager, seq_id, hit, num_external)
    return manager._blocks_of(seq_id, cdiv(hit + num_external, bs))
