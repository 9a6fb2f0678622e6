"""pagedkv's drop-in for vLLM 0.33's ``KVCacheManager`` (docs/integrations/vllm.md).

The scheduler builds its manager from the name ``KVCacheManager`` in its own module and calls it
per admission, per running request and per step; this class answers those calls from one
``pagedkv.KvCacheManager`` with per-chunk allocation (docs/design.md, Per-chunk allocation):

- admission (``allocate_slots`` for a request without blocks) is ``add_sequence(...,
  num_scheduled=n, reserve_prompt=False, require_full_prompt=full_sequence_must_fit)`` with the
  request's own block hashes (``request.block_hashes``), so hits and cached blocks are keyed
  exactly as vLLM keys them, and the whole prompt is checked only when vLLM checks it
  (``scheduler_reserve_full_isl``);
- every later ``allocate_slots`` is one ``allocate_slots`` of the core with the scheduler's
  watermark (``request.num_computed_tokens``, which rolls rejected drafts back) and in-flight
  count, then the ids (and hashes) of the tokens sampled since, as vLLM caches
  ``min(computed + new, request.num_tokens)`` tokens; except a decode step that stays inside
  one block, needs no slot and gives the core nothing to index (full attention only): its
  watermark advance is recorded here and folded into the request's next core call;
- the block ids come back as vLLM's own ``KVCacheBlock`` objects (one per pool block, made once),
  inside vLLM's ``KVCacheBlocks`` (kv_blocks.py: vLLM's class, with a faster
  ``get_block_ids``); block 0 is vLLM's null block (``null_block=0``).

A KV connector's calls (external tokens, async loads, deferred frees) are answered by
connector.py; the encoder blocks of cross-attention groups
(encoder-decoder models) by cross_attention.py. What vLLM's scheduler reaches only with optional
features this manager does not support (Mamba groups, DCP/PCP, hash blocks smaller than blocks,
sparse prefix-cache retention) is refused at construction with ``UnsupportedVllmFeatureError``
naming it (support.py). Speculative decoders' options (EAGLE's dropped hit block, lookahead
hashing, prefill lookahead) are draft.py's, installed at construction. What the scheduler and
connectors read of vLLM's internals (coordinator, per-group managers, block pool) are views.py;
the per-request records and deferred advances records.py; the can-never-fit arithmetic
capacity.py. The class itself holds the construction, ``allocate_slots`` of a running request
(the hot path), ``cache_blocks`` and the frees; the admission path (the look-up and a request's
first ``allocate_slots``) is admission.py's, the per-request queries queries.py's, the per-step
takes, stats and events per_step.py's, bound here as methods.
"""

from __future__ import annotations

import functools
from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request, RequestStatus

import pagedkv
from pagedkv.errors import InvalidArgumentError, UnsupportedVllmFeatureError
from pagedkv.integrations.vllm import (
    admission,
    connector,
    cross_attention,
    draft,
    evict,
    hybrid_hits,
    kv_blocks,
    mamba,
    per_step,
    queries,
    records,
)
from pagedkv.integrations.vllm.capacity import PoolCapacity
from pagedkv.integrations.vllm.events import EventTranslator
from pagedkv.integrations.vllm.support import check_config, checkpoint_alignment
from pagedkv.integrations.vllm.views import BlockPoolView, GroupView, coordinator_view_class

# The error is re-exported: the package and scheduler.py import both names from here.
__all__ = ["KVCacheManager", "UnsupportedVllmFeatureError"]


class KVCacheManager:
    """vLLM 0.33's ``KVCacheManager`` on pagedkv: same constructor, same calls on the
    scheduler's paths, vLLM's own return types. See the module docstring."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        scheduler_block_size: int,
        hash_block_size: int,
        max_in_flight_tokens: int | None = None,
        enable_caching: bool = True,
        use_eagle: bool = False,
        num_hash_lookahead_tokens: int = 0,
        num_prefill_lookahead: int = 0,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        metrics_collector: Any = None,
        watermark: float = 0.0,
        enable_mamba_shared_prefix_checkpoint: bool = False,
    ) -> None:
        block_size, kv_groups = check_config(
            kv_cache_config,
            scheduler_block_size,
            hash_block_size,
            dcp_world_size,
            pcp_world_size,
            metrics_collector,
        )
        if watermark < 0.0:
            raise InvalidArgumentError(f"watermark must be non-negative, got {watermark}")
        drafting = draft.check_options(
            kv_cache_config,
            scheduler_block_size,
            enable_caching,
            use_eagle,
            num_hash_lookahead_tokens,
            num_prefill_lookahead,
        )
        if any(isinstance(g, pagedkv.MambaState) for g in kv_groups):
            mamba.check_options(enable_caching, drafting)
        num_blocks = kv_cache_config.num_blocks
        if max_in_flight_tokens is None:
            max_in_flight_tokens = max_model_len
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        self.metrics_collector = metrics_collector
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.watermark_blocks = int(watermark * num_blocks)
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        self.block_size = block_size
        self.capacity = PoolCapacity(
            num_blocks,
            block_size,
            [
                g.window
                if isinstance(g, pagedkv.SlidingWindow)
                else 2
                if isinstance(g, pagedkv.MambaState)
                else None
                for g in kv_groups
            ],
            max_model_len,
            max_in_flight_tokens,
            [isinstance(g, pagedkv.MambaState) for g in kv_groups],
        )
        # No window group (see PoolCapacity.full_attention_only): a decode step inside one
        # block may skip the core call (records.py), the first look-up reads the first blocks
        # only, and the KV connectors' paths are supported.
        self.full_attention_only = self.capacity.full_attention_only
        self.mamba_shared_prefix_checkpoint = False
        self.retained_hit_group_ids: tuple[int, ...] = ()
        self._record_new_block_ids = bool(getattr(kv_cache_config, "needs_kv_cache_zeroing", False))
        # Cross-attention groups: the decoder core on a pool the encoder blocks share.
        pool = cross_attention.shared_pool(kv_cache_config, num_blocks, block_size, enable_caching, kv_groups)
        self._core = pagedkv.KvCacheManager(
            num_blocks,
            block_size,
            enable_caching,
            pool=pool,
            kv_groups=kv_groups,
            max_model_len=max_model_len,
            max_in_flight_tokens=max_in_flight_tokens,
            watermark_blocks=self.watermark_blocks,
            null_block=0,
            record_new_block_ids=self._record_new_block_ids,
            enable_kv_events=enable_kv_cache_events and enable_caching,
        )
        self.block_pool = BlockPoolView(self, num_blocks, block_size)
        self.coordinator = coordinator_view_class(enable_caching, len(kv_cache_config.kv_cache_groups))(
            self,
            [GroupView(self, i, g.kv_cache_spec) for i, g in enumerate(kv_cache_config.kv_cache_groups)],
            self.block_pool,
        )
        self._cross: cross_attention.EncoderBlocks | None = None
        if pool is not None:
            self._cross = cross_attention.EncoderBlocks(
                self, pool, cross_attention.cross_group_ids(kv_cache_config)
            )
            self.coordinator.single_type_managers = self._cross.group_views(self)
        self._deferred = connector.DeferredFrees()
        # Mamba (state) groups: each request's blocks cached so far (vLLM's num_cached_block,
        # which the KV events' state-group store ranges also start from) and the
        # boundary-state offers not yet taken (mamba.py).
        self._state_groups = [i for i, state in enumerate(self.capacity.states) if state]
        self._states_cached: dict[str, int] = {}
        self._state_offers: list[tuple[str, int, int, int]] = []
        # Requests admitted with the hashes of their hit only (an async load, or a hit capped
        # below what the cache holds): request id -> whether the rest waits for cache_blocks.
        self._held_hashes: dict[str, bool] = {}
        # Hits that get_computed_blocks capped (max_cache_hit_length): request id -> hit tokens.
        self._hit_caps: dict[str, int] = {}
        # Diverged per-group hits a connector's look-up answered this step (hybrid_hits.py).
        self._diverged_hits: dict[str, int] = {}
        self._zero_again: list[int] = []
        # This step's async-load admissions whose external blocks the workers must not zero
        # (the load writes them): (seq id, groups, first and end table positions); applied and
        # dropped at take_new_block_ids.
        self._unzeroed: list[tuple[int, tuple[int, ...], int, int]] = []
        # Speculative decoders' options (draft.py swaps these in when one is set): whether every
        # admission takes its hit's hashes only, the re-prefillable tokens, and the hooks that
        # give a running request's ids and hashes and an admission's held-back hashes.
        self._hold_all_hashes = False
        self._reprefill_tokens = 0
        # Mamba groups' prefill check-points (support.checkpoint_alignment; None: none): every
        # admission and allocation passes the core the rule's inputs, from which token a
        # chunk's end takes one and the alignment. vLLM's coordinator passes its Mamba groups
        # the prefill's end only under sparse retention (refused here); under dense retention
        # every chunk publishes a state (0).
        alignment = checkpoint_alignment(kv_cache_config)
        self._prefill_checkpoint = None if alignment is None else (0, alignment)
        self._give_ids = records.give_ids
        self._give_held_hashes = connector.give_held_hashes
        # vLLM's block objects, one per pool block, made once: the scheduler reads only
        # ``block_id`` (through ``KVCacheBlocks.get_block_ids``).
        self._blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._blocks[0].is_null = True
        # Its get_block_ids, which the scheduler calls for every scheduled request every step,
        # answers without a generator (kv_blocks.py).
        self.empty_kv_cache_blocks = kv_blocks.empty_blocks(self.num_kv_cache_groups)
        # Per request: its record (records.py has the layout).
        self._reqs: dict[str, list[int]] = {}
        self._next_seq_id = 0
        self._events = (
            EventTranslator(
                self._core,
                block_size,
                [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups],
                num_hash_lookahead_tokens=int(num_hash_lookahead_tokens) if drafting else 0,
                state_groups=self._state_groups,
                state_cached_blocks=self._states_cached,
            )
            if self._core_events()
            else None
        )
        if drafting:
            draft.install(self, use_eagle, num_prefill_lookahead)

    def _core_events(self) -> bool:
        return self.enable_kv_cache_events and self.enable_caching

    # The scheduler's other calls, each concept in its own module (the functions are bound here
    # as methods: no call in between, as the scheduler makes some per request per step).

    # Per step (per_step.py): takes, stats, events.
    usage = property(per_step.usage)
    new_step_starts = per_step.new_step_starts
    take_kv_cache_block_copies = per_step.take_kv_cache_block_copies
    take_boundary_state_offloads = per_step.take_boundary_state_offloads
    take_new_block_ids = per_step.take_new_block_ids
    record_blocks_for_zeroing = per_step.record_blocks_for_zeroing
    take_events = per_step.take_events
    make_prefix_cache_stats = per_step.make_prefix_cache_stats
    prefix_cache_lookup_enabled = per_step.prefix_cache_lookup_enabled
    record_prefix_cache_stats = per_step.record_prefix_cache_stats
    reset_prefix_cache = per_step.reset_prefix_cache
    finalize_partial_tail_offloads = per_step.finalize_partial_tail_offloads
    _collect_events = per_step.collect_events

    # Admission (admission.py): the prefix-cache look-up, a request's first allocate_slots.
    get_computed_blocks = admission.get_computed_blocks
    # A connector's look-up, per group where vLLM's is (hybrid_hits.py).
    get_computed_blocks_for_connector = hybrid_hits.get_computed_blocks_for_connector
    _admit = admission.admit

    # Per-request queries (queries.py): blocks, block ids, the cached estimate.
    get_blocks = queries.get_blocks
    get_block_ids = queries.get_block_ids
    get_block_ids_for_computed_tokens = queries.get_block_ids_for_computed_tokens
    estimate_cached_tokens = queries.estimate_cached_tokens
    get_num_common_prefix_blocks = queries.get_num_common_prefix_blocks
    create_kv_cache_blocks = queries.create_kv_cache_blocks
    _blocks_of = queries.blocks_of

    # ---------------------------------------------------------------- allocate_slots

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> KVCacheBlocks | None:
        """Slots for ``num_new_tokens`` (+ lookahead) tokens of ``request``: the blocks newly
        added to its tables, or None when the pool is short (vLLM's signal to preempt)."""
        # The fast path's common case first (a running request's decode step, the scheduler's
        # call with no optional argument): the two quick fences (records.set_fence) say "no
        # filled block of ids, no new hash, no estimate to grow" from two lengths, which implies
        # the general test below; everything else takes the general path.
        state = self._reqs.get(request.request_id)
        if (
            state is not None
            and num_new_tokens
            and not (
                num_new_computed_tokens
                or num_external_computed_tokens
                or delay_cache_blocks
                or reserved_blocks
                or num_encoder_tokens
            )
        ):
            computed = request.num_computed_tokens
            end = computed + num_new_tokens
            if (
                computed == state[5]
                and end + num_lookahead_tokens <= state[7]
                and len(request._all_token_ids) < state[8]
                and len(request.block_hashes) <= state[9]
            ):
                state[5] = end
                return self.empty_kv_cache_blocks
        else:
            # Admissions, optional arguments and invalid calls; a running request's plain call
            # (the test above) skips all of it.
            external = bool(num_external_computed_tokens or delay_cache_blocks or reserved_blocks)
            diverged = False  # the admission takes a diverged hit (hybrid_hits.check_admission)
            if external:
                connector.check_external_admission(
                    self,
                    num_external_computed_tokens,
                    delay_cache_blocks,
                    reserved_blocks,
                    request.num_tokens - num_new_computed_tokens,
                )
                if self._diverged_hits:
                    diverged = hybrid_hits.check_admission(self, request, num_new_computed_tokens)
            if num_encoder_tokens and self._cross is not None:
                # (vLLM ignores encoder tokens without a cross-attention group.)
                return self._cross.admit(
                    self,
                    request,
                    num_new_tokens,
                    num_new_computed_tokens,
                    num_lookahead_tokens,
                    num_encoder_tokens,
                    full_sequence_must_fit,
                    has_scheduled_reqs,
                )
            if num_new_tokens == 0 and num_new_computed_tokens == 0 and num_external_computed_tokens == 0:
                raise InvalidArgumentError(
                    "num_new_tokens must be greater than 0 when there are no computed tokens to adopt"
                )
            if state is None:
                return self._admit(
                    request,
                    num_new_tokens,
                    num_new_computed_tokens,
                    num_lookahead_tokens,
                    full_sequence_must_fit,
                    has_scheduled_reqs,
                    num_external_computed_tokens,
                    delay_cache_blocks,
                    reserved_blocks,
                    diverged,
                    skip_zeroing_group_ids,
                )
            if num_new_computed_tokens or external:
                raise InvalidArgumentError(
                    f"request {request.request_id!r} already holds blocks: no new computed or "
                    "external tokens, no reserved blocks"
                )
            computed = request.num_computed_tokens
            end = computed + num_new_tokens
        # The fast path: a step that stays inside the block the watermark is in, needs no new
        # slot (the fence, state[7], says both) and gives the core nothing new (no id of a
        # filled block, no new hash) changes nothing in the core but its watermark and declared
        # tokens, which nothing reads before this request's next core call: the advance is
        # recorded here and handed to the core with that call (docs/integrations/vllm.md,
        # Deferred watermark advances, proves each condition).
        if computed == state[5] and end + num_lookahead_tokens <= state[7]:
            num_hashes = state[3]
            if num_hashes < 0:  # prefix caching off
                num_tokens = len(request._all_token_ids)
                if num_tokens > state[2]:
                    state[2] = num_tokens
                state[5] = end
                return self.empty_kv_cache_blocks
            bs = self.block_size
            num_tokens = len(request._all_token_ids)
            num_ids = state[2]
            limit = state[1] * bs
            if num_tokens < limit:
                limit = num_tokens
            if limit // bs <= num_ids // bs and (
                len(request.block_hashes) <= num_hashes
                or (num_ids if num_ids > limit else limit) // bs <= num_hashes
            ):
                hashed = num_hashes * bs
                if hashed > state[4]:  # the cached estimate can grow
                    cached = min(end, num_tokens, hashed) // bs * bs
                    if cached > state[4]:
                        state[4] = cached
                state[5] = end
                return self.empty_kv_cache_blocks
        bs = self.block_size
        old_len = state[1]
        seq_id = state[0]
        # Slots whose blocks alone pass the pool can never be allocated: vLLM answers None (the
        # scheduler preempts), the core an error that would stop the step. Reached by a
        # sequence longer than the pool (admitted without the whole-sequence check, or grown
        # past it). A window group holds what its release at the processed watermark leaves.
        slots_end = end + num_lookahead_tokens
        if slots_end > self.max_model_len:
            slots_end = self.max_model_len
        slot_blocks = -(-slots_end // bs)
        # Every group's whole table bounds what they hold: only past the pool is the window
        # release counted (one multiplication per call otherwise). A table already longer
        # (rejected drafts' blocks kept) adds no block.
        capacity = self.capacity
        usable = capacity.usable_blocks
        if slot_blocks * capacity.num_groups > usable and (
            self.full_attention_only
            or capacity.live_blocks(max(slot_blocks, old_len), computed - request.num_in_flight_tokens)
            > usable
        ):
            if not self.full_attention_only:
                connector.release_before_refusal(self, request, state)
            return None
        if (
            self.watermark_blocks
            and has_scheduled_reqs
            and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            and connector.short_of_watermark(self, request, state, slot_blocks)
        ):
            return None
        core_computed = state[6]
        if core_computed != state[5] and computed != state[5]:
            # Rejected drafts roll back from the watermark the core would have.
            records.sync(self, state)
            core_computed = state[6]
        # Deferred advances (core_computed < computed) fold into this call: the core's write
        # starts at its own watermark, in the same block, and ends where the scheduler's does.
        allocate = self._core.allocate_slots
        if self._prefill_checkpoint is not None:
            allocate = functools.partial(allocate, prefill_checkpoint=self._prefill_checkpoint)
        if not allocate(
            seq_id,
            end - core_computed if computed == state[5] else num_new_tokens,
            num_lookahead_tokens=num_lookahead_tokens,
            num_in_flight_tokens=request.num_in_flight_tokens,
            num_computed_tokens=core_computed if computed == state[5] else computed,
        ):
            if self._events is not None:
                self._events.collect(request)  # evictions before the refusal
            return None
        new_len = slot_blocks if slot_blocks > old_len else old_len
        # The core's watermark is end now (the request's moves at the end of schedule()).
        state[1] = new_len
        state[5] = state[6] = end
        self._give_ids(self, request, state, end, None, len(request._all_token_ids))
        records.set_fence(self, state)  # after the ids and hashes given, which it reads
        if self._events is not None:
            self._events.collect(request, state[4])
        if self._state_groups:  # after the events, whose store ranges start at the old end
            mamba.note_cached_states(self, request.request_id, state)
        if new_len == old_len:
            return self.empty_kv_cache_blocks
        return self._blocks_of(seq_id, old_len)

    # ---------------------------------------------------------------- other calls

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Indexes the request's blocks computed and known so far (async scheduling gives the
        ids of sampled tokens here, after their slots were allocated)."""
        state = self._reqs.get(request.request_id)
        if state is None or not self.enable_caching:
            return
        # Async scheduling calls this for every running request every step; on most decode
        # steps the quick fences (records.set_quick_fences) say there is no block of ids to
        # give, no new hash and no estimate to grow, and the watermark is the core's one:
        # what give_ids would find, from two lengths. (A request whose hashes are held for
        # an async load fails the fences anyway, its hashes past its record's; not relied on.)
        if (
            request.num_computed_tokens == state[5]
            and len(request._all_token_ids) < state[8]
            and len(request.block_hashes) <= state[9]
            and not self._held_hashes
        ):
            return
        if self._held_hashes and self._held_hashes.pop(request.request_id, False):
            self._give_held_hashes(self, request, state, num_computed_tokens, True)
        elif self._give_ids(
            self, request, state, num_computed_tokens, request.num_computed_tokens, num_computed_tokens
        ):
            self._collect_events(request, state[4])  # (no core call, no events: most decode steps)
        if self._state_groups:  # after the events, whose store ranges start at the old end
            mamba.note_cached_states(self, request.request_id, state)

    def free(self, request: Request) -> None:
        """Frees the request's blocks (tail first into the evictable cache, as vLLM does)."""
        state = self._reqs.pop(request.request_id, None)
        if state is not None:
            # A deferred watermark advance needs no hand-over: freeing reads no watermark.
            self._free_seq(state[0], request)
        if self._state_groups:
            mamba.forget_cached_states(self, request.request_id)
        if self._held_hashes:
            self._held_hashes.pop(request.request_id, None)
        if self._hit_caps:
            self._hit_caps.pop(request.request_id, None)

    def _free_seq(self, seq_id: int, request: Request, last_group_first: bool = False) -> None:
        if last_group_first:  # a deferred free's order (connector.py)
            self._core.free_last_group_first(seq_id)
        else:
            self._core.free(seq_id)
        if self._cross is not None:
            self._cross.free(seq_id)
        if self._events is not None:
            self._events.collect(request)
            self._events.forget(request.request_id)

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Each window group releases what its window at ``processed_computed_tokens`` leaves
        (a KV connector's path, connector.py; nothing in full-attention groups)."""
        connector.release_skipped(self, request_id, processed_computed_tokens)

    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        """The request's blocks for a deferred free: gone from the manager's view now, back to
        the pool at ``block_pool.free_blocks`` (connector.py)."""
        if self._state_groups:
            mamba.forget_cached_states(self, request.request_id)
        return self._deferred.pop(self, request)

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Drops these blocks from the prefix cache (a KV connector's failed sync load under
        the fail policy; evict.py)."""
        evict.evict_blocks(self, block_ids)

    def check_invariants(self) -> None:
        """The core's allocator invariants, and this manager's record of every request's core
        state: table length and the core's watermark, a deferred advance only inside the
        block the core's watermark is in (``InvariantViolation`` if one does not hold)."""
        self._core.check_invariants()
        records.check(self)
        if self._cross is not None:
            self._cross.check(self)
