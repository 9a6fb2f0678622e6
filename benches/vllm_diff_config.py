"""The parameters of one schedule family of the vLLM differential (``Config``) and the counts of
one schedule (``Outcome``); ``benches/vllm_chunked_prefix.py`` documents the run."""

from __future__ import annotations

from dataclasses import dataclass, field

Windows = tuple[int | None, ...]  # one entry per KV group: None full attention, else the window


@dataclass
class Config:
    """One schedule family: pool, block size, prompt shapes."""

    num_blocks: int = 48
    block_size: int = 4
    steps: int = 200
    num_prefixes: int = 3
    prefix_tokens: int = 40
    max_suffix: int = 24
    vocab: int = 6  # small: decode tokens and suffixes collide, so generated blocks hit too
    windows: Windows = ()  # KV groups (None: full attention); empty: one full-attention group
    watermark_blocks: int = 0  # blocks an admission must leave free (vLLM's watermark)
    # Async scheduling: a decode step's slot is allocated before its id is known; the id
    # arrives at the request's next decode step, after that step's allocation (one token in
    # flight meanwhile, so window releases run at computed - 1).
    async_ids: bool = False
    # Speculative decoding: up to this many draft tokens per decode step (0: none), each
    # accepted with probability 1/2; the rejected ones are rolled back by the watermark.
    max_drafts: int = 0
    lookahead: int = 0  # draft slots beyond the scheduled tokens (EAGLE-style), never hashed


@dataclass
class Outcome:
    admissions: int = 0
    hits: int = 0
    hit_tokens: int = 0
    ooms: int = 0
    preemptions: int = 0
    drafts: int = 0  # draft tokens scheduled
    rejected: int = 0  # of them, rolled back
    async_ids: int = 0  # ids given after their slots (and a later step's allocation)
    steps: int = 0
    released_positions: int = 0  # hybrid: out-of-window table positions, summed over steps
    mismatches: list[str] = field(default_factory=list)
    # the first explained divergence, after which the schedule stops (see run_schedule)
    diverged: str = ""
