"""Speculative decoders' options of pagedkv's vLLM manager (docs/integrations/vllm.md, Draft
models): EAGLE's dropped hit block (``use_eagle``), lookahead hashing
(``num_hash_lookahead_tokens``) and prefill lookahead (``num_prefill_lookahead``, the
re-prefilled tokens of multi-token prediction, used by DFlash/DSpark block drafters too).

How vLLM 0.33's manager answers them on one full-attention group (its unitary coordinator),
and how this module gives the same answers:

- **EAGLE's dropped hit block**: the hit is the longest run of cached blocks within
  ``max_cache_hit_length`` less its last block, which the request recomputes (the drafter needs
  the hidden states of the tokens before the generation point). Here: the same look-up, then
  the drop; the admission is given the hashes of the dropped hit only, so the core takes exactly
  that hit (the dropped block is allocated anew and computed, as in vLLM), and the request's
  other hashes right after it.
- **Lookahead hashing**: the request's hasher covers the ``L`` tokens after each block, so a
  hash arrives only once those tokens exist (after its block's ids): the manager gives hashes as
  they arrive (records.give_ids already treats a new hash as news). The hit is unchanged; the
  KV events carry the lookahead tokens (``lookahead_token_ids``) and the extra keys of the
  block and its lookahead window, as vLLM's block pool writes them (events.py).
- **Prefill lookahead** ``P``: the last ``P - 1`` computed tokens may be re-prefilled, so vLLM
  caches ``n - (P - 1)`` of the ``n`` tokens it is asked to cache. Here: the core indexes the
  full blocks below its watermark and the known ids that have hashes, so the manager gives it no
  hash past ``(n - (P - 1)) // block_size`` blocks (never fewer than it gave: vLLM never
  uncaches). ``n`` is what vLLM caches at each call: ``min(computed + new, num_tokens)`` at
  ``allocate_slots``, the argument of ``cache_blocks``.

Everything here is installed at construction (``install``) and only when an option is set with
prefix caching on (without it vLLM caches nothing and the options change nothing): the plain
configuration keeps the manager's own paths, untouched.

On several groups, or one sliding-window group, vLLM's coordinators answer the same options
with two differences, both followed here: EAGLE's drop applies to the groups vLLM marks as
EAGLE groups, each finder looking one block past the candidate hit before dropping back
(eagle_hits.py); and without the drop (lookahead hashing clears it) its hybrid coordinator
caches the re-prefillable tokens too (no cap). Refused, by name: these options beside a Mamba,
cross-attention or other group kind; prefill lookahead with the drop on some groups only
(vLLM caches those groups to another point than the rest).

A KV connector's tokens (vLLM turns lookahead hashing off with a connector, so EAGLE there
always drops): the local hit is the dropped one; a synchronous load's admission is given its
hit's hashes and then the others up to the cap, as any admission here; an asynchronous load's
hashes are held until it finished and then given by connector.give_held_hashes (its
watermark rule) up to the same cap (``give_held_hashes``).
"""

from __future__ import annotations

import functools
from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec
from vllm.v1.request import Request

from pagedkv.errors import InvalidArgumentError, UnsupportedVllmFeatureError
from pagedkv.integrations.vllm import connector, eagle_hits, records
from pagedkv.integrations.vllm.eagle_hits import drop_group_ids
from pagedkv.integrations.vllm.hit_blocks import hit_blocks

# The manager (manager.py) is typed ``Any`` here: manager.py imports this module, and the
# package's layering forbids import cycles, typing-only ones included (tests/python/test_layering.py).
KVCacheManager = Any


def _named(use_eagle: bool, num_hash_lookahead_tokens: int, num_prefill_lookahead: int) -> str:
    names = []
    if use_eagle:
        names.append("EAGLE's prefix-hit block drop (use_eagle)")
    if num_hash_lookahead_tokens:
        names.append(f"lookahead hashing (num_hash_lookahead_tokens={num_hash_lookahead_tokens})")
    if num_prefill_lookahead:
        names.append(f"prefill lookahead (num_prefill_lookahead={num_prefill_lookahead})")
    return " / ".join(names)


def check_options(
    kv_cache_config: KVCacheConfig,
    scheduler_block_size: int,
    enable_caching: bool,
    use_eagle: bool,
    num_hash_lookahead_tokens: int,
    num_prefill_lookahead: int,
) -> bool:
    """Whether the options change anything (an option set, prefix caching on); raises vLLM's
    own refusal (``InvalidArgumentError``, a ``ValueError``) or the unsupported combination
    named (``UnsupportedVllmFeatureError``)."""
    if num_hash_lookahead_tokens < 0 or num_prefill_lookahead < 0:
        raise InvalidArgumentError(
            f"negative num_hash_lookahead_tokens ({num_hash_lookahead_tokens}) or "
            f"num_prefill_lookahead ({num_prefill_lookahead})"
        )
    if not enable_caching or not (use_eagle or num_hash_lookahead_tokens or num_prefill_lookahead):
        return False
    groups = kv_cache_config.kv_cache_groups
    if any(type(g.kv_cache_spec) not in (FullAttentionSpec, SlidingWindowSpec) for g in groups):
        raise UnsupportedVllmFeatureError(
            f"{_named(use_eagle, num_hash_lookahead_tokens, num_prefill_lookahead)} with "
            f"{len(groups)} KV-cache groups ({', '.join(type(g.kv_cache_spec).__name__ for g in groups)}): "
            "pagedkv's vLLM manager supports them on full-attention and sliding-window groups"
        )
    drops = drop_group_ids(kv_cache_config, use_eagle)
    one_token = [i for i in drops if getattr(groups[i].kv_cache_spec, "sliding_window", None) == 1]
    if one_token:
        # vLLM caches such a window's blocks only for the drop's peek; the core caches none.
        raise UnsupportedVllmFeatureError(
            f"EAGLE's dropped hit block on a sliding window of one token (KV-cache group {one_token[0]})"
        )
    if len(groups) > 1 and num_prefill_lookahead > 1 and drops and len(drops) < len(groups):
        # vLLM's hybrid coordinator caches an EAGLE group's blocks up to the finalized tokens
        # and the others' up to the computed ones: two caching points per request, where the
        # core keeps one (the request's hashes).
        raise UnsupportedVllmFeatureError(
            f"prefill lookahead (num_prefill_lookahead={num_prefill_lookahead}) with EAGLE's "
            f"dropped block on some KV-cache groups only (is_eagle_group on {sorted(drops)} of "
            f"{len(groups)}): vLLM caches those groups' blocks to a different point"
        )
    # vLLM's coordinator refuses a prefill lookahead past one block on an EAGLE group: the
    # dropped tail (one block) must hold the re-prefilled tokens.
    if (
        use_eagle or any(getattr(g, "is_eagle_group", False) for g in groups)
    ) and scheduler_block_size < num_prefill_lookahead:
        raise InvalidArgumentError(
            f"Multi-module MTP with prefix caching requires scheduler_block_size"
            f" (={scheduler_block_size}) >= num_speculative_tokens"
            f" (={num_prefill_lookahead})."
        )
    return True


def install(manager: KVCacheManager, use_eagle: bool, num_prefill_lookahead: int) -> None:
    """Switches the manager's hooks to this module's (see the module docstring): with EAGLE's
    drop or prefill lookahead, every admission takes the hashes of its hit only
    (``_hold_all_hashes``) and gets the others capped; with prefill lookahead, the running
    requests' hashes are capped too; with EAGLE's drop, ``get_computed_blocks`` drops the
    hit's last block (eagle_hits.py for more than one full-attention group).

    The re-prefilled tokens are left uncached as vLLM's coordinators leave them: one group
    (its unitary coordinator) always; several (its hybrid coordinator) only in the groups
    that drop a block, all of them or none here (check_options refuses a mix)."""
    config = manager.kv_cache_config
    drops = drop_group_ids(config, use_eagle)
    reprefill = max(0, num_prefill_lookahead - 1)
    hybrid = len(config.kv_cache_groups) > 1
    manager._reprefill_tokens = 0 if hybrid and not drops else reprefill
    if not (drops or manager._reprefill_tokens):
        return  # lookahead hashing alone: the manager's own paths (events.py writes its events)
    manager._hold_all_hashes = True
    manager._give_held_hashes = give_held_hashes
    if manager._reprefill_tokens:
        manager._give_ids = give_ids
    if drops:
        # An instance attribute: the plain configuration's look-up stays the class's own.
        look_up = (
            get_computed_blocks if manager.full_attention_only and not hybrid else get_hybrid_computed_blocks
        )
        manager.get_computed_blocks = functools.partial(look_up, manager)
        manager._eagle_drop_groups = drops


def _hash_cap(manager: KVCacheManager, state: list[int], num_tokens_to_cache: int) -> int:
    """The most hashes the core may hold: vLLM caches ``num_tokens_to_cache`` less the
    re-prefillable tokens, and never uncaches."""
    cap = (num_tokens_to_cache - manager._reprefill_tokens) // manager.block_size
    return cap if cap > state[3] else state[3]


class _CappedHashes:
    """A request as records.give_ids reads it (its ids and hashes), with the hashes cut at the
    prefill-lookahead cap."""

    __slots__ = ("_all_token_ids", "block_hashes")

    def __init__(self, request: Request, num_hashes: int) -> None:
        self._all_token_ids = request._all_token_ids
        self.block_hashes = request.block_hashes[:num_hashes]


def give_ids(
    manager: KVCacheManager,
    request: Request,
    state: list[int],
    end: int,
    watermark: int | None,
    upto: int,
) -> bool:
    """records.give_ids with the hashes past the prefill-lookahead cap held back: the core's
    watermark after the call (``watermark``, or the recorded one) bounds what vLLM caches at
    this call, and so does ``upto`` (``num_tokens`` at ``allocate_slots``, the argument of
    ``cache_blocks``)."""
    computed = state[5] if watermark is None else watermark
    cap = _hash_cap(manager, state, computed if computed < upto else upto)
    if cap < len(request.block_hashes):
        return records.give_ids(manager, _CappedHashes(request, cap), state, end, watermark, upto)
    return records.give_ids(manager, request, state, end, watermark, upto)


def give_held_hashes(
    manager: KVCacheManager, request: Request, state: list[int], end: int, loaded: bool
) -> None:
    """After an admission given the hashes of its hit only: the others, as far as the ids and
    the prefill-lookahead cap reach (vLLM's ``cache_blocks(request, min(end, num_tokens))`` at
    the end of its ``allocate_slots``), with the core's watermark ``end``. After a KV
    connector's async load (``loaded``): connector.give_held_hashes (the load's watermark rule)
    with the same cap, of the ``end`` tokens vLLM's ``cache_blocks`` is given when the load
    finished."""
    if loaded:
        connector.give_held_hashes(
            manager,
            request,
            state,
            end,
            True,
            max_hashes=_hash_cap(manager, state, min(end, request.num_tokens)),
        )
        return
    bs = manager.block_size
    num_tokens = request.num_tokens
    num_hashes = state[3]
    all_hashes = request.block_hashes
    hashes_end = min(len(all_hashes), state[2] // bs, _hash_cap(manager, state, min(end, num_tokens)))
    if hashes_end > num_hashes:
        # (the core's watermark stops at the known ids, as in connector.give_held_hashes)
        manager._core.provide_token_ids(
            state[0],
            [],
            num_computed_tokens=end if end <= state[2] else state[2],
            block_hashes=all_hashes[num_hashes:hashes_end],
        )
        state[3] = hashes_end
        if manager._events is not None:
            manager._events.collect(request)
    cached = min(end, num_tokens, state[3] * bs) // bs * bs
    if cached > state[4]:
        state[4] = cached


def _bound(manager: KVCacheManager, request: Request, max_cache_hit_length: int | None) -> int | None:
    """A look-up's bound (default ``num_tokens - 1``), None when the request skips the cache.
    A capped hit's note goes: the admission takes exactly the hit (``_hold_all_hashes``)."""
    if not manager.prefix_cache_lookup_enabled(request):
        return None
    if manager._hit_caps:
        manager._hit_caps.pop(request.request_id, None)
    return request.num_tokens - 1 if max_cache_hit_length is None else max_cache_hit_length


def _answer(
    manager: KVCacheManager, request: Request, hit: int, boundary: int
) -> tuple[KVCacheBlocks, int, int]:
    """The look-up's answer for a hit of ``hit`` tokens (its "full" report-mode events too)."""
    if hit == 0:
        return manager.empty_kv_cache_blocks, 0, boundary
    if manager._events is not None and getattr(request, "kv_cache_report_mode", None) == "full":
        manager._events.report_hit(request, hit // manager.block_size, manager.num_kv_cache_groups)
    return hit_blocks(manager, request.block_hashes, hit), hit, boundary


def get_computed_blocks(
    manager: KVCacheManager, request: Request, max_cache_hit_length: int | None = None
) -> tuple[KVCacheBlocks, int, int]:
    """vLLM's hit with EAGLE's drop on one full-attention group: the longest run of cached
    blocks within ``max_cache_hit_length`` (default ``num_tokens - 1``), less its last block.
    The admission takes exactly this hit (``_hold_all_hashes``)."""
    bound = _bound(manager, request, max_cache_hit_length)
    if bound is None:
        return manager.empty_kv_cache_blocks, 0, 0
    bs = manager.block_size
    all_hashes = request.block_hashes
    # capped at the pool's blocks, as get_computed_blocks' (admission.py)
    num_blocks = min(max(0, bound) // bs, len(all_hashes), manager.capacity.usable_blocks)
    if num_blocks == 0:
        return manager.empty_kv_cache_blocks, 0, 0
    hit = manager._core.match_prefix(
        request._all_token_ids[: num_blocks * bs + 1], block_hashes=all_hashes[:num_blocks]
    )
    # nothing, or one block, dropped: no hit
    return _answer(manager, request, hit - bs if hit > bs else 0, 0)


def get_hybrid_computed_blocks(
    manager: KVCacheManager, request: Request, max_cache_hit_length: int | None = None
) -> tuple[KVCacheBlocks, int, int]:
    """vLLM's hit with EAGLE's drop on several groups or a sliding-window group
    (eagle_hits.py), and its shared-prefix boundary. The admission takes exactly this hit
    (``_hold_all_hashes``)."""
    bound = _bound(manager, request, max_cache_hit_length)
    if bound is None:
        return manager.empty_kv_cache_blocks, 0, 0
    hit, boundary = eagle_hits.find_longest_cache_hit(
        manager, request.block_hashes, bound, manager._eagle_drop_groups
    )
    return _answer(manager, request, hit, boundary)
