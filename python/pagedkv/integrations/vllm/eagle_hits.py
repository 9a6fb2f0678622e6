"""EAGLE's dropped hit block on several KV-cache groups, or on one sliding-window group, as vLLM
0.33's coordinators look it up (docs/integrations/vllm.md, Draft models, "EAGLE on hybrid
groups").

With ``use_eagle`` (and no lookahead hashing, which clears it) every group vLLM marks as an
EAGLE group drops the last block of its own hit: the drafter needs the hidden states of the
tokens before the generation point, so they are recomputed. Which groups: those whose
``KVCacheGroupSpec.is_eagle_group`` is set, or all of them when none is (vLLM's conservative
fall-back). A spec set (the groups of one spec, looked up together) drops when any member does.

vLLM's per-group finders with the drop, blocks of one size, hits on block boundaries:

- full attention: the leading run of cached blocks, less one block;
- a sliding window of ``w`` tokens: from the right, the first run of ``cdiv(w - 1, bs) + 1``
  cached blocks (one more than without the drop), or a shorter run from block 0; then its last
  block dropped.

One group (vLLM's unitary coordinator): its finder within ``max_cache_hit_length``. Several
(its hybrid coordinator): the fixed point of ``find_longest_cache_hit``, in which a dropping
finder looks one block past the candidate length (``eagle_proof_margin``) and lands back on it,
a full-attention set is looked up once and then only trimmed, each dropping set drops at most
once per candidate length, and a full attention + one other spec configuration stops after one
round (vLLM's ``is_simple_hybrid``). Its third answer, the shared-prefix boundary, is the
longest hit any set reached on the way when it passes the reconciled hit.

pagedkv's core then admits exactly this hit: the admission is given the hashes of the hit only
(draft.py), and the core's own hit rules (the leading run; the window's blocks before the hit)
hold at it, since each finder's run covers them. Each position is looked up by one hash
(hybrid_hits.cached_in_groups, vLLM's ``get_cached_block``). Mamba groups are refused with the
drop (draft.py): vLLM's Mamba finder follows EAGLE's replay boundary through check-points.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig

from pagedkv.integrations.vllm.capacity import cdiv
from pagedkv.integrations.vllm.hybrid_hits import cached_in_groups, spec_groups

# The manager (manager.py) is typed ``Any`` here, as in hybrid_hits.py (no import cycles).
KVCacheManager = Any


def drop_group_ids(kv_cache_config: KVCacheConfig, use_eagle: bool) -> frozenset[int]:
    """The groups whose hits drop their last block (vLLM's ``drop_eagle_group_ids``), spread
    over each spec set (vLLM's coordinator marks every group of a set one of whose groups
    drops: ``SpecGroup.use_eagle``, and its managers cache by that mark)."""
    if not use_eagle:
        return frozenset()
    groups = kv_cache_config.kv_cache_groups
    flagged = {i for i, g in enumerate(groups) if getattr(g, "is_eagle_group", False)}
    if not flagged:
        return frozenset(range(len(groups)))
    specs = [g.kv_cache_spec for g in groups]
    return frozenset(
        i for i, s in enumerate(specs) if any(type(specs[j]) is type(s) and specs[j] == s for j in flagged)
    )


def _full_attention_run(
    manager: KVCacheManager, hashes: Sequence[Any], group_ids: list[int], max_blocks: int
) -> int:
    """Blocks of the leading run cached in every group of ``group_ids``."""
    run = 0
    while run < max_blocks and cached_in_groups(manager, hashes[run], group_ids) is not None:
        run += 1
    return run


def _window_run_end(
    manager: KVCacheManager, hashes: Sequence[Any], group_ids: list[int], max_blocks: int, need: int
) -> int:
    """The block after the rightmost run of ``need`` cached blocks below ``max_blocks``, else
    the length of the run from block 0 (vLLM's ``SlidingWindowManager`` finder)."""
    run = 0
    for i in range(max_blocks - 1, -1, -1):
        if cached_in_groups(manager, hashes[i], group_ids) is None:
            run = 0
            continue
        run += 1
        if run >= need:
            return i + run
    return run


def find_longest_cache_hit(
    manager: KVCacheManager, hashes: Sequence[Any], max_cache_hit_length: int, drop_groups: frozenset[int]
) -> tuple[int, int]:
    """``(hit tokens, shared-prefix boundary)``: vLLM's look-up with EAGLE's drop (module doc)."""
    bs = manager.block_size
    sets = [(spec, ids, any(g in drop_groups for g in ids)) for spec, ids in spec_groups(manager)]
    if not sets:
        return 0, 0
    num_hashed = len(hashes) * bs
    unitary = len(manager.kv_cache_config.kv_cache_groups) == 1

    def look_up(spec: Any, ids: list[int], bound: int, drop: bool) -> int:
        max_blocks = min(bound // bs, len(hashes))
        if isinstance(spec, FullAttentionSpec):
            blocks = _full_attention_run(manager, hashes, ids, max_blocks)
        else:
            need = cdiv(spec.sliding_window - 1, bs) + (1 if drop else 0)
            blocks = _window_run_end(manager, hashes, ids, max_blocks, need)
        if drop and blocks:
            blocks -= 1
        return blocks * bs

    if unitary:
        spec, ids, drop = sets[0]
        return look_up(spec, ids, max(max_cache_hit_length, 0), drop), 0
    simple = len(sets) == 2 and isinstance(sets[0][0], FullAttentionSpec)
    hit_length = max(max_cache_hit_length, 0)
    longest = 0
    full_hits: dict[int, int] = {}  # a full-attention set's own hit, looked up once
    verified: set[int] = set()  # the sets whose drop holds at the current candidate length
    while True:
        current = hit_length
        for idx, (spec, ids, eagle) in enumerate(sets):
            if isinstance(spec, FullAttentionSpec) and idx in full_hits:
                current = min(current, full_hits[idx])
                continue
            drop = eagle and idx not in verified
            # A dropping finder looks one block further and drops back to the candidate.
            bound = min(current + bs, num_hashed) if drop else current
            found = look_up(spec, ids, bound, drop)
            if isinstance(spec, FullAttentionSpec):
                full_hits[idx] = found
            if drop:
                verified.add(idx)
            elif found < current:
                verified.clear()
            current = found
            longest = max(longest, current)
        if current >= hit_length:
            break
        hit_length = current
        if simple:
            break
    return hit_length, (longest if longest > hit_length else 0)
