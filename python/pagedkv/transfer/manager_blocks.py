"""A request's blocks read off a ``KvCacheManager``: what the prefill side offers and where the
decode side puts them (docs/transfer.md, What the engine calls).

Only the manager's public calls (``kv_groups``, ``block_table``, ``num_computed_tokens``): the
engine integration calls these two functions rather than slicing tables itself.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedkv.errors import InvalidArgumentError
from pagedkv.transfer.params import KvTransferParams

__all__ = ["destination_block_ids", "source_block_ids"]


def _windows(kv: Any) -> list[int | None]:
    return [getattr(group, "window", None) for group in kv.kv_groups]


def source_block_ids(kv: Any, seq_id: int, num_tokens: int | None = None) -> list[list[int]]:
    """Per KV group, the blocks of sequence ``seq_id``'s first ``num_tokens`` tokens (default:
    its computed tokens) that a decode side needs: every block of a full-attention group; of a
    sliding-window group of window ``W`` only those from the one holding token
    ``num_tokens - W`` on (what the next token's window can still see; the manager may have
    released some of them already, ``-1`` in its table: those are left out from the front).
    A ``-1`` after a kept block would be a hole in the window: ``InvalidArgumentError``."""
    if num_tokens is None:
        num_tokens = kv.num_computed_tokens(seq_id)
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise InvalidArgumentError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
    if num_tokens > kv.num_tokens(seq_id):
        raise InvalidArgumentError(
            f"sequence {seq_id} holds {kv.num_tokens(seq_id)} tokens, not {num_tokens}"
        )
    bs = kv.block_size
    num_blocks = -(-num_tokens // bs)
    out = []
    for g, window in enumerate(_windows(kv)):
        table = np.asarray(kv.block_table(seq_id, group=g))[:num_blocks]
        first = 0 if window is None else max(0, num_tokens - window) // bs
        kept = table[first:]
        held = np.flatnonzero(kept >= 0)
        kept = kept[held[0] :] if held.size else kept[:0]
        if (kept < 0).any():
            raise InvalidArgumentError(
                f"sequence {seq_id}'s group {g} has a released block inside its window"
            )
        out.append([int(b) for b in kept])
    return out


def destination_block_ids(
    kv: Any, seq_id: int, params: KvTransferParams, num_cached_tokens: int
) -> tuple[list[list[int]], list[list[int]]]:
    """(dst_block_ids, skip) for ``TransferSink.start``: sequence ``seq_id``'s blocks at the
    positions ``params`` sends, and the positions to skip: those its prefix-cache hit of
    ``num_cached_tokens`` tokens covers in whole blocks (already held, shared: never written)
    and those its table has released (``-1``). The sequence must hold the params' tokens."""
    if kv.block_size != params.block_size:
        raise InvalidArgumentError(
            f"the params' blocks hold {params.block_size} tokens, ours {kv.block_size}"
        )
    if len(kv.kv_groups) != params.num_groups:
        raise InvalidArgumentError(f"the params have {params.num_groups} KV groups, ours {len(kv.kv_groups)}")
    if kv.num_tokens(seq_id) < params.num_tokens:
        raise InvalidArgumentError(
            f"sequence {seq_id} holds {kv.num_tokens(seq_id)} tokens; the params send {params.num_tokens}"
        )
    held_blocks = num_cached_tokens // params.block_size
    dst, skip = [], []
    for g in range(params.num_groups):
        first = params.first_position(g)
        table = np.asarray(kv.block_table(seq_id, group=g))[first : params.num_logical_blocks]
        positions = first + np.arange(table.shape[0])
        dst.append([int(b) for b in table])
        skip.append([int(i) for i in np.flatnonzero((positions < held_blocks) | (table < 0))])
    return dst, skip
