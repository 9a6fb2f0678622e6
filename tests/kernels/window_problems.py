"""Sliding-window test problems: what a sliding-window KV group releases, and poison before the
window, on a PrefillProblem (decode problems are prefill problems with one query per sequence)."""

from __future__ import annotations

from .conftest import nan_fill_value
from .prefill_problems import PrefillProblem


def first_keys(p: PrefillProblem, window: int) -> list[int]:
    """Each sequence's first key any of its queries sees (its whole context without queries)."""
    return [
        max(0, int(p.seq_lens[b]) - n - window + 1) if n else int(p.seq_lens[b])
        for b, n in enumerate(p.q_lens)
    ]


def release_out_of_window(p: PrefillProblem, window: int) -> None:
    """What a sliding-window KV group releases: blocks wholly before the window, NaN and -1."""
    bs = p.paged.k_cache.shape[1]
    fill = nan_fill_value(p.paged.kind)
    for b, first in enumerate(first_keys(p, window)):
        for i in range(first // bs):
            block = p.paged.block_tables[b, i]
            p.paged.k_cache[block] = fill
            p.paged.v_cache[block] = fill
            p.paged.block_tables[b, i] = -1


def poison_before_window(p: PrefillProblem, window: int) -> None:
    """NaN in every still-mapped slot before each sequence's first visible key (slots of the first
    visible block, which a kernel must skip or mask without loading)."""
    bs = p.paged.k_cache.shape[1]
    fill = nan_fill_value(p.paged.kind)
    for b, first in enumerate(first_keys(p, window)):
        for pos in range(first):
            block = int(p.paged.block_tables[b, pos // bs])
            if block >= 0:
                p.paged.k_cache[block, pos % bs] = fill
                p.paged.v_cache[block, pos % bs] = fill


def release_decode_blocks(p: PrefillProblem, seq_lens, window: int) -> None:
    """release_out_of_window for decode rows of lengths ``seq_lens`` (not p.seq_lens): the blocks
    wholly before each row's window NaN and -1, e.g. a step before the one p's lengths describe."""
    bs = p.paged.k_cache.shape[1]
    fill = nan_fill_value(p.paged.kind)
    for b, n in enumerate(seq_lens):
        for i in range(max(0, int(n) - window) // bs):
            block = p.paged.block_tables[b, i]
            if block >= 0:
                p.paged.k_cache[block] = fill
                p.paged.v_cache[block] = fill
                p.paged.block_tables[b, i] = -1
