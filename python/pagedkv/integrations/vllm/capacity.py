"""What the pool can ever hold, for the "can never fit" answers of pagedkv's vLLM manager.

vLLM answers ``None`` to an allocation whose blocks alone pass the pool (the scheduler then keeps
the request waiting, or preempts), where the core refuses such a call with an error that would
stop the scheduler's step; the manager asks these questions first (docs/integrations/vllm.md).
The counts are the core's: a sliding-window group holds what its release at the processed
watermark leaves, and at admission at most its cap (``window - 1 + max_in_flight_tokens`` tokens
plus one block). A leaf module: the manager and connector.py both import it.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


class PoolCapacity:
    """The pool's usable blocks and the per-group block counts of the can-never-fit checks."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        windows: list[int | None],
        max_model_len: int,
        max_in_flight_tokens: int,
        states: list[bool] | None = None,
    ) -> None:
        # Block 0 is vLLM's null block: never allocated, never counted as free.
        self.usable_blocks = num_blocks - 1
        self.block_size = block_size
        # Per group: its window in tokens (None: full attention).
        self.windows = windows
        # The core's groups (a cross-attention group's encoder blocks are not among them).
        self.num_groups = len(windows)
        # No window group: every group keeps every position (the deferred watermark advances,
        # the first-blocks look-up and the KV connectors' paths rely on it).
        self.full_attention_only = all(w is None for w in windows)
        self.max_model_len = max_model_len
        self.max_in_flight_tokens = max_in_flight_tokens
        # Per group: whether it is a Mamba state group (its window is then 2 tokens: its
        # release; it takes one block per allocation, and its table is as long as the others).
        self.states = states or [False] * len(windows)
        self.has_state = any(self.states)

    def live_blocks(self, positions: int, processed: int) -> int:
        """Blocks ``positions`` table positions hold over every group once each window group
        released what its window at ``processed`` tokens leaves (the core's count)."""
        if self.full_attention_only:  # every group keeps every position (each admission asks)
            return positions * self.num_groups
        bs = self.block_size
        total = 0
        for window, state in zip(self.windows, self.states, strict=True):
            skipped = 0 if window is None else max(processed - (window - 1), 0) // bs
            live = positions - min(skipped, positions)
            total += min(live, 1) if state else live
        return max(total, positions) if self.has_state else total

    def admission_cap_blocks(self, window: int) -> int:
        """A window group's admission cap in blocks (vLLM's ``max_admission_blocks_per_request``)."""
        return cdiv(min(window - 1 + self.max_in_flight_tokens, self.max_model_len), self.block_size) + 1

    def prompt_blocks(self, num_tokens: int, external: int = 0) -> int:
        """vLLM's whole-prompt admission requirement without a hit (a window group at most its
        admission cap, less what its window at ``external`` computed tokens skips: a KV
        connector's, counted as computed before sizing)."""
        bs = self.block_size
        # (a comparison rather than min(): each admission asks)
        full = cdiv(num_tokens if num_tokens < self.max_model_len else self.max_model_len, bs)
        if self.full_attention_only:  # (each admission asks)
            return full * self.num_groups
        total = 0
        for window, state in zip(self.windows, self.states, strict=True):
            if window is None:
                total += full
            elif state:
                total += min(max(full - max(external - 1, 0) // bs, 0), 1)
            else:
                skipped = max(external - (window - 1), 0) // bs
                total += max(min(full, self.admission_cap_blocks(window)) - skipped, 0)
        return max(total, full) if self.has_state else total
