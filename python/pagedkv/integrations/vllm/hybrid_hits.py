"""Each KV-cache group's own prefix hit, as vLLM 0.33's hybrid coordinator reports it for KV
connectors (docs/integrations/vllm.md, KV connectors, "Per-group hits").

vLLM's ``HybridKVCacheCoordinator.find_longest_cache_hit_per_group`` runs every group's hit
finder on its own, with no fixed point between them: the groups of one spec (equal specs, one
manager class) are looked up together (a block counts as cached only when every group of the
set holds one under the hash), and

- full attention: the leading run of cached blocks (vLLM's ``FullAttentionManager``);
- a sliding window of ``w`` tokens: from the right, the first run of ``cdiv(w - 1, bs)`` cached
  blocks, or a shorter run from block 0, its earlier positions the null block
  (``SlidingWindowManager``);
- a Mamba state (``"align"`` mode): the rightmost cached block, the positions before it the null
  block (``MambaManager``).

The answer is vLLM's: per group its hit blocks (``KVCacheBlock``, block 0 the null block) and
its hit length in tokens. Each position is pagedkv's look-up by one hash,
``KvCacheManager.cached_block(hash, group=g)`` (the question vLLM's ``BlockPool.get_cached_block``
answers; aux_outputs.py), so the answers are vLLM's for the same cached contents
(docs/conformance.md, Duplicate copies, for where the contents differ).

``get_computed_blocks_for_connector`` (the scheduler's look-up when its connector
``supports_divergent_local_hybrid_hits``) is ``get_computed_blocks``'s unless the config has a
Mamba group and a full-attention group, as vLLM's manager decides it. A diverged hit (full
attention deeper than a Mamba group's) is vLLM's answer too, recorded for the step
(``manager._diverged_hits``, cleared at ``new_step_starts``): the scheduler falls back to the
reconciled hit when the connector has no tokens, and an admission of the diverged hit with
the connector's tokens is the core's ``diverged_hit`` admission (``check_admission``, then
the manager's admission with ``diverged_hit``: full attention's own run as the hit, the Mamba
groups' rows and count as vLLM's; docs/integrations/vllm.md, Mamba, "Per-group hit
divergence"), refused by name only on a config the core option does not cover
(full-attention groups of several specs, whose runs vLLM looks up apart). The Mamba rule
answers vLLM's finder on pagedkv's index (checked against vLLM's ``MambaManager`` in
tests/vllm/test_vllm_mamba_connector.py).

Nothing here is on the scheduler's hot path: vLLM calls the per-group look-up only for a
connector that asks for it (the offloading connector's bound, the divergent-hit look-up).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

from pagedkv.errors import InvalidArgumentError, UnsupportedVllmFeatureError
from pagedkv.integrations.vllm.capacity import cdiv

# The manager (manager.py) is typed ``Any`` here: manager.py imports views.py, which imports
# this module, and the package's layering forbids import cycles (tests/python/test_layering.py).
KVCacheManager = Any


def spec_groups(manager: KVCacheManager) -> list[tuple[Any, list[int]]]:
    """vLLM's ``attention_groups``: the decoder groups by equal spec (one block pool here, and
    one manager class per spec type), in group order, full attention first (vLLM's stable
    sort). Cross-attention groups take no part (vLLM's look-up raises on one; they come only
    without prefix caching here, support.py)."""
    sets: list[tuple[Any, list[int]]] = []
    for g, group in enumerate(manager.kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if not isinstance(spec, (FullAttentionSpec, SlidingWindowSpec, MambaSpec)):
            continue
        for same, ids in sets:
            if type(same) is type(spec) and same == spec:
                ids.append(g)
                break
        else:
            sets.append((spec, [g]))
    sets.sort(key=lambda s: not isinstance(s[0], FullAttentionSpec))
    return sets


def cached_in_groups(manager: KVCacheManager, block_hash: Any, group_ids: list[int]) -> list[int] | None:
    """The block each group of ``group_ids`` holds under ``block_hash``, or None when one misses
    (vLLM's ``get_cached_block`` over the set)."""
    core = manager._core
    out = []
    for g in group_ids:
        b = core.cached_block(block_hash, group=g)
        if b is None:
            return None
        out.append(b)
    return out


def _full_attention_hit(
    manager: KVCacheManager, hashes: Sequence[Any], group_ids: list[int], max_blocks: int
) -> list[list[int]]:
    rows: list[list[int]] = [[] for _ in group_ids]
    for i in range(min(max_blocks, len(hashes))):
        found = cached_in_groups(manager, hashes[i], group_ids)
        if found is None:
            break
        for row, b in zip(rows, found, strict=True):
            row.append(b)
    return rows


def _window_hit(
    manager: KVCacheManager, hashes: Sequence[Any], group_ids: list[int], max_blocks: int, window: int
) -> list[list[int]]:
    contiguous = cdiv(window - 1, manager.block_size)
    rows = [[0] * max_blocks for _ in group_ids]
    run = 0
    for i in range(max_blocks - 1, -1, -1):
        found = cached_in_groups(manager, hashes[i], group_ids)
        if found is None:
            run = 0
            continue
        for row, b in zip(rows, found, strict=True):
            row[i] = b
        run += 1
        if run >= contiguous:
            return [row[: i + run] for row in rows]
    # No full run: the run reaching block 0 (possibly empty) is the hit.
    return [row[:run] for row in rows]


def _state_hit(
    manager: KVCacheManager, hashes: Sequence[Any], group_ids: list[int], max_blocks: int
) -> list[list[int]]:
    for i in range(max_blocks - 1, -1, -1):
        found = cached_in_groups(manager, hashes[i], group_ids)
        if found is not None:
            return [[0] * i + [b] for b in found]
    return [[] for _ in group_ids]


def find_longest_cache_hit_per_group(
    manager: KVCacheManager, block_hashes: Sequence[Any], max_cache_hit_length: int
) -> tuple[tuple[list[KVCacheBlock], ...], tuple[int, ...]]:
    """vLLM's ``HybridKVCacheCoordinator.find_longest_cache_hit_per_group`` (module doc):
    ``(blocks per group, hit tokens per group)``; a group that takes no part in look-ups (a
    cross-attention group) has no blocks and 0 tokens, and so does every group without prefix
    caching (nothing is cached)."""
    if isinstance(max_cache_hit_length, bool) or not isinstance(max_cache_hit_length, int):
        raise InvalidArgumentError(f"max_cache_hit_length must be an int, got {max_cache_hit_length!r}")
    num_groups = len(manager.kv_cache_config.kv_cache_groups)
    hit_ids: list[list[int]] = [[] for _ in range(num_groups)]
    lengths = [0] * num_groups
    bs = manager.block_size
    max_blocks = max(max_cache_hit_length, 0) // bs
    if manager.enable_caching and max_blocks:
        hashes = block_hashes
        if max_blocks > len(hashes) and any(
            not isinstance(s, FullAttentionSpec) for s, _ in spec_groups(manager)
        ):
            # vLLM's window and Mamba finders read a hash for every block below the bound (an
            # IndexError there); its callers pass at most the request's tokens less one.
            raise InvalidArgumentError(
                f"max_cache_hit_length {max_cache_hit_length} reaches past the {len(hashes)} "
                "block hashes given"
            )
        for spec, group_ids in spec_groups(manager):
            if isinstance(spec, FullAttentionSpec):
                rows = _full_attention_hit(manager, hashes, group_ids, max_blocks)
            elif isinstance(spec, SlidingWindowSpec):
                rows = _window_hit(manager, hashes, group_ids, max_blocks, spec.sliding_window)
            else:
                rows = _state_hit(manager, hashes, group_ids, max_blocks)
            for g, row in zip(group_ids, rows, strict=True):
                hit_ids[g] = row
                lengths[g] = len(row) * bs
    blocks = manager._blocks
    return tuple([blocks[b] for b in row] for row in hit_ids), tuple(lengths)


def diverges(manager: KVCacheManager) -> bool:
    """Whether vLLM's ``get_computed_blocks_for_connector`` looks per group on this config: a
    Mamba group beside a full-attention group, with prefix caching (vLLM's hybrid coordinator
    and its ``full_attention_group_id``)."""
    groups = manager.kv_cache_config.kv_cache_groups
    return (
        manager.enable_caching
        and len(groups) > 1
        and any(isinstance(g.kv_cache_spec, MambaSpec) for g in groups)
        and manager.coordinator.full_attention_group_id is not None
    )


def get_computed_blocks_for_connector(
    manager: KVCacheManager, request: Any, max_cache_hit_length: int | None = None
) -> tuple[Any, int, int, bool]:
    """vLLM's ``KVCacheManager.get_computed_blocks_for_connector``: the local hit, the
    shared-prefix boundary and whether the hit diverged (full attention's hit deeper than a
    lagging group's, which only a connector's tokens can back).

    Without a Mamba group it is ``get_computed_blocks``'s answer, not diverged. With one: each
    group's own hit; a group deeper than full attention (its full-attention blocks were
    evicted) falls back to ``get_computed_blocks`` (the reconciled hit), as does a look-up
    vLLM's skips; otherwise full attention's hit, diverged when a group lags it."""
    if not diverges(manager):
        return (*manager.get_computed_blocks(request, max_cache_hit_length), False)
    if not manager.prefix_cache_lookup_enabled(request):
        return manager.empty_kv_cache_blocks, 0, 0, False
    if max_cache_hit_length is None:
        max_cache_hit_length = request.num_tokens - 1
    fa = manager.coordinator.full_attention_group_id
    computed, hits = find_longest_cache_hit_per_group(manager, request.block_hashes, max_cache_hit_length)
    if any(hit > hits[fa] for hit in hits):
        return (*manager.get_computed_blocks(request, max_cache_hit_length), False)
    num_local = hits[fa]
    if min(hits) < num_local:
        # vLLM's answer: full attention's hit, diverged. The scheduler then asks its connector;
        # with no external tokens it falls back to get_computed_blocks (the reconciled hit,
        # answered as there). With them the admission takes the diverged hit
        # (check_admission), a capped look-up's held to its cap as below.
        request_id = request.request_id
        manager._diverged_hits[request_id] = num_local
        manager._hit_caps.pop(request_id, None)
        if max_cache_hit_length < request.num_tokens - 1:
            manager._hit_caps[request_id] = num_local
        return manager.create_kv_cache_blocks(computed), num_local, 0, True
    # Every group agrees: that hit is the reconciled one (each finder maps it to itself), so
    # the admission takes it as it takes get_computed_blocks' (a capped look-up's hit held to
    # its cap, as there). vLLM reports no shared-prefix boundary and no hit events here.
    request_id = request.request_id
    manager._hit_caps.pop(request_id, None)
    if max_cache_hit_length < request.num_tokens - 1:
        manager._hit_caps[request_id] = num_local
    return manager.create_kv_cache_blocks(computed), num_local, 0, False


def check_admission(manager: KVCacheManager, request: Any, num_new_computed_tokens: int) -> bool:
    """Whether an admission with a connector's tokens takes a diverged hit
    (``get_computed_blocks_for_connector``'s, in this step): then the manager admits it with
    ``diverged_hit`` (admission.py, the core's option: full attention's own run as the hit; each
    Mamba group's rows and vLLM's count, its own lagging hit block counted when cached-evictable).
    An admission with another hit (the scheduler's fallback to the reconciled one) goes on as
    usual (False). Refused by name where the core's option does not answer vLLM: besides the
    Mamba groups, full-attention groups of more than one spec (vLLM looks each spec's run up
    apart, so one may lag another; the core's run is every full-attention group's)."""
    diverged = manager._diverged_hits.pop(request.request_id, None)
    if diverged is None or diverged != num_new_computed_tokens:
        return False
    kinds = [spec for spec, _ in spec_groups(manager)]
    full = [s for s in kinds if isinstance(s, FullAttentionSpec)]
    if len(full) != 1 or any(not isinstance(s, (FullAttentionSpec, MambaSpec)) for s in kinds):
        raise UnsupportedVllmFeatureError(
            f"request {request.request_id!r}: a KV connector's tokens on top of a diverged local "
            f"hit ({diverged} tokens of full attention) on groups the core's diverged admission "
            "does not cover (full attention of one spec and Mamba only: "
            "supports_divergent_local_hybrid_hits)"
        )
    return True
