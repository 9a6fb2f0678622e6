"""What vLLM's auxiliary-output connector reads of the KV-cache manager, answered by
pagedkv's core (docs/integrations/vllm.md, Auxiliary outputs).

vLLM 0.33's ``AuxOutputSchedulerConnector`` (``aux_output_config``, e.g. routed experts) keeps
a block's auxiliary outputs while its KV stays in the prefix cache, and asks the block pool one
question about it, ``block_pool.get_cached_block(block_hash, [group])``: is a block of that
group cached under this hash (in use or cached-evictable)? It asks it of one hash at a time, in
any order: walking a waiting request's hashes (``max_cache_hit``, which continues past a block
whose outputs it retains although its KV is gone), a finishing request's computed blocks
(``request_finished``), and the retained blocks past its capacity, by their hash alone
(``_release_unheld``). Only whether the answer is ``None`` is read. It also reads the
coordinator's ``full_attention_group_id`` (the group it asks about), the group's block size and
the pool's hash block size.

The core answers the question exactly: ``KvCacheManager.cached_block(hash, group=g)`` is the
block its index holds under the content hash (the request's own ``block_hashes``, reduced to
128 bits as at admission), chained blocks included (the core's first such look-up gives each a
map entry, and later admissions chain none). The blocks vLLM's pool holds under a hash and the
blocks pagedkv's index holds are the same contents, except where vLLM indexes a second copy of
one content (docs/conformance.md, Duplicate copies: pagedkv keeps one) and the blocks of a
request that skips reading the prefix cache (not written here).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.kv_cache_interface import FullAttentionSpec

# The manager (manager.py) is typed ``Any`` here: manager.py imports views.py, which imports
# this module, and the package's layering forbids import cycles (tests/python/test_layering.py).
KVCacheManager = Any


def get_cached_block(
    manager: KVCacheManager, block_hash: Any, kv_cache_group_ids: list[int]
) -> list[KVCacheBlock] | None:
    """vLLM's ``BlockPool.get_cached_block``: the block cached under ``block_hash`` in each
    group of ``kv_cache_group_ids``, or ``None`` when any group misses (a group the manager
    does not have misses, as in vLLM's pool, which holds no block of it)."""
    core = manager._core
    blocks = manager._blocks
    out = []
    for group in kv_cache_group_ids:
        if not 0 <= group < manager.num_kv_cache_groups:
            return None
        b = core.cached_block(block_hash, group=group)
        if b is None:
            return None
        out.append(blocks[b])
    return out


def full_attention_group_id(kv_cache_config: Any, enable_caching: bool) -> int | None:
    """vLLM's ``coordinator.full_attention_group_id``: with prefix caching and several groups
    (vLLM's hybrid coordinator), the first full-attention group; ``None`` otherwise (vLLM's
    other coordinators have no such attribute, which its connector reads as group 0 too)."""
    groups = kv_cache_config.kv_cache_groups
    if not enable_caching or len(groups) < 2:
        return None
    return next((i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, FullAttentionSpec)), None)
