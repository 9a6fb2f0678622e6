"""The per-request records of pagedkv's vLLM manager, and the deferred watermark advances.

Each request the manager holds blocks for has a record, a plain list (indexed by position on the
hot path; a list reads faster than attributes there):

    [0] seq id in the core
    [1] table length in blocks
    [2] token ids given to the core
    [3] block hashes given (-1: never: prefix caching is off)
    [4] tokens cached (the ``estimate_cached_tokens`` answer, block-aligned)
    [5] the computed-tokens watermark the core has once the deferred advances reach it
    [6] the core's watermark now
    [7] the fence of ``allocate_slots``' fast path (``set_fence``; -1: never)
    [8] the quick fence on the request's token ids: fewer than this, no block of ids filled
        (``set_fence``; -1: the general test decides)
    [9] the quick fence on its block hashes: at most this many, no new hash (``set_fence``)

[5] and [6] differ only after deferred advances: a running request's decode step that stays
inside its block, needs no slot and gives the core nothing new makes no core call; the advance
is folded into the request's next core call (docs/integrations/vllm.md, Deferred watermark
advances, proves each condition). Full attention only: a window group's release reads every
call's watermark.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.request import Request

from pagedkv.errors import InvariantViolation

# The manager (manager.py) is typed ``Any`` here: manager.py imports this module, and the
# package's layering forbids import cycles, typing-only ones included (tests/python/test_layering.py).
KVCacheManager = Any


# A quick fence that never stops a length.
_NO_LIMIT = 1 << 62


def set_fence(manager: KVCacheManager, state: list[int]) -> None:
    """state[7]: the most tokens plus lookahead a step may reach without a core call, from the
    watermark state[5] and the table state[1]: the last token of the watermark's block, within
    the table and max_model_len (stays -1 with a window group). And the quick fences (below)."""
    if manager.full_attention_only:
        bs = manager.block_size
        # Plain comparisons rather than min(): a builtin min() of three ints costs more than
        # the rest of this function (its arguments' tuple and keyword parsing).
        fence = (state[5] // bs + 1) * bs - 1
        table_end = state[1] * bs
        if table_end < fence:
            fence = table_end
        if manager.max_model_len < fence:
            fence = manager.max_model_len
        state[7] = fence
        set_quick_fences(manager, state)


def set_quick_fences(manager: KVCacheManager, state: list[int]) -> None:
    """state[8] and state[9], from the table state[1], the ids state[2], the hashes state[3] and
    the estimate state[4]: ``len(token ids) < state[8] and len(block hashes) <= state[9]``
    says what ``allocate_slots``' general fast-path test says of the ids and hashes (no
    ``give_ids`` call, no estimate to grow), with two reads. With ``n = state[2] // bs``
    blocks of ids given: the ids of a block fill once there are ``(n + 1) * bs`` tokens, if
    the table reaches past block ``n`` (else never, within the table); a new hash is news only
    while fewer than ``n`` blocks are hashed (the hashes go no further than the ids). A record
    whose hashes could raise the estimate (or that gives no hashes) gets -1: the general test
    decides. Whoever changes state[1] to state[3] calls this again (``set_fence`` does);
    the estimate only grows, which keeps the fences valid. ``check`` compares them."""
    num_hashes = state[3]
    bs = manager.block_size
    if num_hashes < 0 or num_hashes * bs > state[4] or not manager.full_attention_only:
        state[8] = state[9] = -1
        return
    ids_blocks = state[2] // bs
    state[8] = (ids_blocks + 1) * bs if state[1] > ids_blocks else _NO_LIMIT
    state[9] = num_hashes if ids_blocks > num_hashes else _NO_LIMIT


def sync(manager: KVCacheManager, state: list[int]) -> None:
    """Hands the core a request's deferred watermark advance: the one core call the skipped ones
    add up to (the same block, no new slot, nothing indexed)."""
    manager._core.allocate_slots(state[0], state[5] - state[6], num_computed_tokens=state[6])
    state[6] = state[5]


def give_ids(
    manager: KVCacheManager,
    request: Request,
    state: list[int],
    end: int,
    watermark: int | None,
    upto: int,
) -> bool:
    """Gives the core the ids (and hashes) of tokens sampled since, as far as the request's
    slots reach; updates the cached-tokens estimate for ``end`` scheduled tokens.
    ``watermark``: the scheduler's computed tokens after rejected drafts (None: the core's
    stands, as right after ``allocate_slots``). ``upto``: ids beyond are held back (vLLM's
    ``cache_blocks(request, n)`` caches no block past ``n``, e.g. in-flight tokens).
    Returns whether it called the core (only then can there be events to collect). Sets the
    fences (``set_fence``) when given a watermark; ``allocate_slots`` sets them after it.

    ``allocate_slots``' fast path restates the "nothing new" condition below inline (measured:
    0.42 us a decode step against 0.76 us through this function); the sabotage tests of
    tests/vllm/test_vllm_deferred_watermark.py fail if the two drift apart."""
    # Plain comparisons rather than min()/max(): this runs on every core allocate_slots.
    num_ids, num_hashes = state[2], state[3]
    num_tokens = len(request._all_token_ids)
    if num_hashes < 0:  # prefix caching off
        if num_tokens > num_ids:
            state[2] = num_tokens
        return False
    bs = manager.block_size
    limit = state[1] * bs
    if upto < limit:
        limit = upto
    if num_tokens < limit:
        limit = num_tokens
    all_hashes = request.block_hashes
    # A hash can arrive after its block's ids: a hasher with lookahead tokens hashes a block
    # once the tokens after it exist (e.g. a request that finishes at its prefill's sampled
    # token), so new hashes alone are news too. Hashes go no further than the known ids.
    known = num_ids if num_ids > limit else limit
    hashes_end = len(all_hashes)
    if known // bs < hashes_end:
        hashes_end = known // bs
    # The ids of a block the core cannot index yet (not full, or no hash) change nothing
    # there: they wait, one call per block instead of one per decode step (the per-call
    # cost, benches/results/2026-12-06-vllm-scheduler-v2.md). What cannot wait: a new
    # hash, a block filled, or a watermark other than the core's (rejected drafts).
    called = False
    if (
        hashes_end > num_hashes
        or limit // bs > num_ids // bs
        or (watermark is not None and watermark != state[5])
    ):
        if state[6] != state[5]:
            sync(manager, state)  # the core checks the watermark against its own
        new_hashes = all_hashes[num_hashes:hashes_end]
        manager._core.provide_token_ids(
            state[0],
            request._all_token_ids[num_ids:limit] if limit > num_ids else [],
            num_computed_tokens=watermark,
            block_hashes=new_hashes,
        )
        state[2] = known
        if hashes_end > num_hashes:
            state[3] = num_hashes = hashes_end
        if watermark is not None:
            state[5] = state[6] = watermark
        called = True
    hashed = num_hashes * bs
    grown = False
    if hashed > state[4]:  # the cached estimate can grow
        cached = min(end, num_tokens, hashed) // bs * bs
        if cached > state[4]:
            state[4] = cached
            grown = cached == hashed
    # The fences read the estimate: set after it. Without a watermark (allocate_slots), the
    # caller sets them after this call.
    if watermark is not None:
        if called:
            set_fence(manager, state)
        elif grown:
            set_quick_fences(manager, state)  # -1 while the estimate could grow
    return called


def check(manager: KVCacheManager) -> None:
    """Every record against the core: table length and the core's watermark, a deferred advance
    only inside the block the core's watermark is in (``InvariantViolation`` if one does not
    hold)."""
    core = manager._core
    bs = manager.block_size
    for request_id, state in manager._reqs.items():
        seq_id, table_len, core_computed = state[0], state[1], state[6]
        actual = (len(core.block_table(seq_id)), core.num_computed_tokens(seq_id))
        deferred_ok = state[5] == core_computed or (
            manager.full_attention_only and core_computed < state[5] and state[5] // bs == core_computed // bs
        )
        if actual != (table_len, core_computed) or not deferred_ok:
            raise InvariantViolation(
                f"request {request_id!r}: recorded table length, core watermark and "
                f"watermark {(table_len, core_computed, state[5])}, the core's {actual}"
            )
        # The quick fences are what the record says now (a stale one could skip a core call
        # the general test makes); -1 always holds (the general test decides).
        quick = state[8:10]
        set_quick_fences(manager, state)
        if quick[0] != -1 and quick != state[8:10]:
            raise InvariantViolation(
                f"request {request_id!r}: quick fences {quick}, the record gives {state[8:10]}"
            )
        state[8:10] = quick
