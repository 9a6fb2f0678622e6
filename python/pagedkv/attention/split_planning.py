"""How many splits a decode launch cuts each sequence into: from occupancy, in whole waves.

A decode grid has ``base_ctas = num_seqs * num_kv_heads`` thread blocks (CTAs) per split. The GPU
runs ``num_sms * ctas_per_sm`` of them at once (one wave); a grid of 1.2 waves takes as long as two
full ones. More splits fill more of the machine but each CTA carries a fixed cost (prologue, the
partial result it writes) and more than one split adds a merge launch. So the planner predicts
each candidate's time in "token steps" (the time one CTA needs for one token of K and V):

    cost(s) = waves(s) * (tokens_per_split(s) + CTA_OVERHEAD_TOKENS) + (MERGE_COST_TOKENS if s > 1)

and takes the fewest splits whose cost is within SPLIT_MARGIN of the cheapest (a wave-rounding
gain of a few percent does not pay for many more CTAs and partial results). ``ctas_per_sm``
comes from the compiled kernel's registers and shared memory (``ctas_per_sm_from_resources``,
the CUDA occupancy rules), or from the driver's occupancy API where the cuda runner has it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The cost constants are predictions, not measurements (no GPU has timed these kernels yet;
# docs/decode_kernel.md section 2): the device benchmark's num_splits sweep is to calibrate them.
MIN_TOKENS_PER_SPLIT = 128  # below this the per-CTA and merge costs dominate the KV reads
CTA_OVERHEAD_TOKENS = 32  # a CTA's fixed cost (q load, softmax state, partial write) in token steps
MERGE_COST_TOKENS = 128  # the merge launch in token steps of one CTA (docs/decode_kernel.md, 2.)
SPLIT_MARGIN = 0.05  # take the fewest splits whose predicted cost is within 5 % of the cheapest


def visible_tokens(max_seq_len: int, window: int | None, tile_tokens: int) -> int:
    """The most keys one decode CTA row walks under a sliding ``window`` (None: all max_seq_len):
    only the blocks in the window are visible, so splits are planned over them, not the whole
    context. A kernel may start its key loop up to ``tile_tokens - 1`` keys early, at the first
    visible key's block or tile (the tensor-core decode kernel does, masking those keys), so the
    span it walks is at most window + tile_tokens - 1."""
    if window is None or window <= 0:
        return max_seq_len
    return min(max_seq_len, window + tile_tokens - 1)


@dataclass(frozen=True)
class SmLimits:
    """Per-SM resources that bound how many CTAs are resident (one architecture)."""

    registers: int = 65536
    register_unit: int = 256  # registers are allocated per warp in units of this many
    max_threads: int = 2048
    max_ctas: int = 32
    shared_bytes: int = 233472  # 228 KiB
    shared_unit: int = 128
    shared_reserved_per_cta: int = 1024  # the driver reserves 1 KiB per CTA


SM90 = SmLimits()  # H100 / H200


def ctas_per_sm_from_resources(
    registers_per_thread: int, shared_bytes_per_cta: int, threads_per_cta: int, limits: SmLimits = SM90
) -> int:
    """Resident CTAs per SM for a kernel using these resources (the occupancy calculator's rules:
    the minimum over the thread, CTA, register and shared-memory limits). At least 1."""
    warps = math.ceil(threads_per_cta / 32)
    by_threads = limits.max_threads // (warps * 32)
    regs_per_warp = math.ceil(max(1, registers_per_thread) * 32 / limits.register_unit) * limits.register_unit
    by_registers = limits.registers // (regs_per_warp * warps)
    shared = math.ceil((shared_bytes_per_cta + limits.shared_reserved_per_cta) / limits.shared_unit)
    by_shared = limits.shared_bytes // (shared * limits.shared_unit)
    return max(1, min(limits.max_ctas, by_threads, by_registers, by_shared))


@dataclass(frozen=True)
class SplitPlan:
    num_splits: int
    tokens_per_split: int  # a whole number of tiles
    num_ctas: int  # base_ctas * num_splits
    slots: int  # num_sms * ctas_per_sm: CTAs resident at once
    waves: int  # ceil(num_ctas / slots)
    cost_token_steps: int  # the model's predicted time (see module doc)

    @property
    def wave_efficiency(self) -> float:
        """Share of the slots busy over the grid's waves (1.0: whole waves)."""
        return self.num_ctas / (self.waves * self.slots)


def _candidate(base_ctas: int, max_seq_len: int, tile_tokens: int, slots: int, splits: int) -> SplitPlan:
    tokens = math.ceil(math.ceil(max_seq_len / splits) / tile_tokens) * tile_tokens
    splits = max(1, math.ceil(max_seq_len / tokens))  # no empty trailing split
    ctas = base_ctas * splits
    waves = math.ceil(ctas / slots)
    cost = waves * (tokens + CTA_OVERHEAD_TOKENS) + (MERGE_COST_TOKENS if splits > 1 else 0)
    return SplitPlan(splits, tokens, ctas, slots, waves, cost)


def plan_splits(
    base_ctas: int,
    max_seq_len: int,
    tile_tokens: int,
    num_sms: int,
    ctas_per_sm: int,
    requested: int | None = None,
    max_splits: int = 256,
    min_tokens_per_split: int = MIN_TOKENS_PER_SPLIT,
) -> SplitPlan:
    """The split plan for a decode grid of base_ctas CTAs per split over sequences of at most
    max_seq_len tokens. ``requested`` forces a split count (capped at max_splits)."""
    base_ctas, num_sms, ctas_per_sm = max(1, base_ctas), max(1, num_sms), max(1, ctas_per_sm)
    slots = num_sms * ctas_per_sm
    if max_seq_len <= 0:
        return _candidate(base_ctas, 1, tile_tokens, slots, 1)
    if requested is not None:
        return _candidate(base_ctas, max_seq_len, tile_tokens, slots, min(max(1, requested), max_splits))
    min_tokens = math.ceil(min_tokens_per_split / tile_tokens) * tile_tokens
    most = max(1, min(max_splits, max_seq_len // min_tokens))  # every split >= min_tokens
    candidates = [_candidate(base_ctas, max_seq_len, tile_tokens, slots, s) for s in range(1, most + 1)]
    cheapest = min(c.cost_token_steps for c in candidates)
    # The model is rough: a gain within SPLIT_MARGIN does not pay for more splits.
    return next(c for c in candidates if c.cost_token_steps <= cheapest * (1 + SPLIT_MARGIN))
