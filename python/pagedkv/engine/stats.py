"""EngineStats: what one engine did, counted per step."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["EngineStats"]


@dataclass
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0  # tokens whose K/V were computed as prefill
    decode_tokens: int = 0
    generated_tokens: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens served from any tier (device, host cache, store)
    store_hit_tokens: int = 0  # of those, from the store
    # The store's misses nobody would otherwise see: admissions whose look-up the deadline cut
    # short (the rest of the prompt was computed), and blocks that never reached it.
    store_deadline_misses: int = 0
    store_puts_written: int = 0  # blocks the store worker wrote
    store_puts_dropped: int = 0  # refused by a full queue, or still queued when the engine closed
    store_puts_failed: int = 0  # the store refused or raised
    draft_tokens: int = 0  # speculative drafts verified
    accepted_tokens: int = 0  # drafts equal to the token the model chose
    decode_passes: int = 0  # decode rows (one sequence in one pass, with or without drafts)
    decode_generated: int = 0  # tokens sampled from decode rows
    recompute_preemptions: int = 0
    swap_preemptions: int = 0
    cow_copies: int = 0
    failed_requests: int = 0  # finished with finish_reason "error"
    batch_sizes: list[int] = field(default_factory=list)  # sequences per forward pass
    blocks_in_use: list[int] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        return {
            "steps": self.steps,
            "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens,
            "generated_tokens": self.generated_tokens,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "store_hit_tokens": self.store_hit_tokens,
            "store_deadline_misses": self.store_deadline_misses,
            "store_puts_written": self.store_puts_written,
            "store_puts_dropped": self.store_puts_dropped,
            "store_puts_failed": self.store_puts_failed,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0,
            # Tokens one sequence gains per decode pass: 1 without speculation.
            "tokens_per_pass": self.decode_generated / self.decode_passes if self.decode_passes else 0.0,
            "recompute_preemptions": self.recompute_preemptions,
            "swap_preemptions": self.swap_preemptions,
            "cow_copies": self.cow_copies,
            "failed_requests": self.failed_requests,
            "mean_batch": float(np.mean(self.batch_sizes)) if self.batch_sizes else 0.0,
            "mean_blocks_in_use": float(np.mean(self.blocks_in_use)) if self.blocks_in_use else 0.0,
            "max_blocks_in_use": max(self.blocks_in_use, default=0),
        }
