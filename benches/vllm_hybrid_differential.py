"""Differential run of pagedkv's hybrid KV groups against vLLM v1's real hybrid
``KVCacheManager`` (its ``HybridKVCacheCoordinator`` over a ``FullAttentionSpec`` group and
``SlidingWindowSpec`` groups on one ``BlockPool``): the randomized chunked-prefill schedules of
``benches/vllm_chunked_prefix.py`` (shared prefixes, chunks of random size, decode steps that
cross window boundaries, frees, preemptions, evictions on small pools) drive
``pagedkv.KvCacheManager(kv_groups=[FullAttention(), SlidingWindow(window=W), ...])`` and vLLM
built with the same groups.

    $VENV/bin/python benches/vllm_hybrid_differential.py [--schedules 200] [--steps 300] [--seed 0]

(``$VENV``: the peer venv with vLLM 0.33, pagedkv importable; see ``vllm_chunked_prefix.py``.)

Compared, on top of everything the full-attention run compares (every admission's hit:
``match_prefix`` == ``add_sequence``'s return == vLLM's ``get_computed_blocks``; the hit covers
only computed blocks; admissions and decode steps fit on both sides alike; blocks in use and
``num_computed_tokens`` after every step):
- per group, the distinct blocks the running requests hold;
- per running request and group, which table positions are released: pagedkv's ``-1`` against
  vLLM's null block, i.e. vLLM's rule (a window group drops every block whose tokens all lie
  before ``num_computed_tokens - W + 1``);
- copy-choice divergences are detected over every group's hit blocks.

When a window group releases, and why both sides must agree on it: vLLM frees out-of-window
blocks at the start of ``allocate_slots`` (admission, each later chunk, each decode token), from
the request's ``num_computed_tokens`` *before* the tokens that pass schedules, because the pass
still reads the window of its first token: a pass scheduling positions ``[c, c+k)`` may drop
only the blocks wholly before ``c - W + 1``. pagedkv's watermark already counts a pass's tokens
when it is scheduled (``add_sequence(num_scheduled=)``, ``advance_computed``, ``append_tokens``),
so the same rule applied to the moved watermark would free a block the pass is about to read.
No settling is done on either side: after every step vLLM's tables are compared as its
scheduler leaves them.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared schedule machinery

from vllm_chunked_prefix import Config, main, run_schedule  # noqa: E402

__all__ = ["CONFIGS", "run_schedule"]

FULL = None  # a full-attention group in Config.windows

CONFIGS = {
    # window of exactly one block: a hit needs one cached window block before its end
    "window-1-block": Config(num_blocks=64, windows=(FULL, 4)),
    # windows that are not multiples of the block size
    "window-6": Config(num_blocks=64, windows=(FULL, 6)),
    "window-10-tiny-pool": Config(num_blocks=40, prefix_tokens=30, max_suffix=16, windows=(FULL, 10)),
    "block16-window40": Config(
        num_blocks=80, block_size=16, prefix_tokens=160, max_suffix=80, vocab=50, windows=(FULL, 40)
    ),
    # a window longer than most prompts: released positions appear only on the long ones
    "block16-window512": Config(
        num_blocks=160, block_size=16, prefix_tokens=600, max_suffix=160, vocab=50, windows=(FULL, 512)
    ),
    # two window groups of different sizes: vLLM's coordinator iterates to a fixed point
    "two-windows": Config(num_blocks=96, windows=(FULL, 5, 13)),
    # no eviction: the per-chunk growth of every group and the hits alone
    "large-pool-window7": Config(num_blocks=4096, steps=150, windows=(FULL, 7)),
    # async scheduling: releases at computed - in flight, ids a step late
    "async-window6": Config(num_blocks=64, async_ids=True, windows=(FULL, 6)),
    # drafts rolled back by the watermark, lookahead slots, and the watermark on admission
    "spec-window10": Config(num_blocks=64, max_drafts=3, lookahead=1, watermark_blocks=2, windows=(FULL, 10)),
}

if __name__ == "__main__":
    sys.exit(main(configs=CONFIGS, doc=__doc__))
