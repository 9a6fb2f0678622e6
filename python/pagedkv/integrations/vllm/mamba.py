"""Mamba groups in align mode on the plain path (docs/integrations/vllm.md, Mamba): what a
manager with a ``MambaSpec`` group refuses besides the group options support.py checks, and the
boundary-state offers vLLM's ``MambaManager`` makes of the state blocks it caches. The group
itself is the core's ``pagedkv.MambaState`` (one block per allocation at the chunk's last
position, the 2-token window's release, hits at the rightmost cached state block, same-step
refusals after ``new_step``); the manager's calls map to the core's as for attention groups."""

from __future__ import annotations

from typing import Any

from pagedkv.errors import UnsupportedVllmFeatureError

# The manager (manager.py) is typed ``Any`` here: manager.py imports this module, and the
# package's layering forbids import cycles, typing-only ones included (tests/python/test_layering.py).
KVCacheManager = Any


def check_options(enable_caching: bool, drafting: bool) -> None:
    """Refuses, by name, the options the plain Mamba path does not answer as vLLM does."""
    if not enable_caching:
        raise UnsupportedVllmFeatureError("a Mamba group without prefix caching (mamba_cache_mode='none')")
    if drafting:
        raise UnsupportedVllmFeatureError("a Mamba group with speculative decoding (lookahead tokens)")


def admitted_cached_blocks(hit_tokens: int, external_tokens: int, block_size: int) -> int:
    """vLLM's ``num_cached_block`` of a state group right after an admission: its per-group
    manager pads the positions whose states are no longer needed (all computed tokens but the
    last, a connector's included) with null blocks, then adds the hit's blocks past them, and
    counts all of them cached. Without a connector's tokens: the hit's blocks."""
    computed = hit_tokens + external_tokens
    skipped = (computed - 1) // block_size if computed else 0
    return max(skipped, hit_tokens // block_size)


def note_cached_states(manager: KVCacheManager, request_id: str, state: list[int]) -> None:
    """vLLM's boundary-state offers of a request's state blocks cached since the last call
    (from the record: where the last call ended, or at admission ``admitted_cached_blocks``), read
    from the record's cached tokens (records.py, [4]: the blocks vLLM's ``cache_blocks`` reaches)
    and the state groups' tables. vLLM's ``MambaManager`` offers every non-null block its
    ``cache_blocks`` caches in align mode, with its boundary (the tokens up to its end), for a
    KV connector to offload; ``take_boundary_state_offloads`` drains them. The record it
    advances (``manager._states_cached``, vLLM's ``num_cached_block``) is also where the KV
    events' next state-group store range starts (events.py): called after that call's events
    are drained."""
    end = state[4] // manager.block_size
    start = manager._states_cached.get(request_id, end)
    manager._states_cached[request_id] = max(start, end)
    if end <= start:
        return
    bs = manager.block_size
    for g in manager._state_groups:
        table = manager._core.block_table(state[0], group=g)[start:end].tolist()
        manager._state_offers.extend(
            (request_id, g, b, (start + i + 1) * bs) for i, b in enumerate(table) if b > 0
        )


def forget_cached_states(manager: KVCacheManager, request_id: str) -> None:
    """The request's blocks go back to the pool: its offers not yet taken go too (as vLLM's
    ``pop_blocks_for_free`` drops them: another request may be handed the blocks)."""
    manager._states_cached.pop(request_id, None)
    if any(offer[0] == request_id for offer in manager._state_offers):
        manager._state_offers = [offer for offer in manager._state_offers if offer[0] != request_id]


def take_offers(manager: KVCacheManager) -> dict[str, list[tuple[int, int, int]]]:
    """``take_boundary_state_offloads``: ``{request id: [(group, block id, boundary tokens)]}``,
    group by group as vLLM's manager drains its per-group lists."""
    offers, manager._state_offers = manager._state_offers, []
    out: dict[str, list[tuple[int, int, int]]] = {}
    for g in manager._state_groups:
        for request_id, group, block, tokens in offers:
            if group == g:
                out.setdefault(request_id, []).append((g, block, tokens))
    return out
