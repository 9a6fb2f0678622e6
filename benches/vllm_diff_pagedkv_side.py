"""pagedkv's side of the vLLM differential: its ``KvCacheManager`` behind the calls a schedule
makes (``benches/vllm_chunked_prefix.py`` documents the run)."""

from __future__ import annotations

from typing import Any

import pagedkv
from vllm_diff_config import Windows


class PagedkvSide:
    """pagedkv's manager behind the calls the schedule makes, with the per-chunk contract
    (docs/embedding.md, Per-chunk allocation): ``add_sequence(..., num_scheduled=k,
    reserve_prompt=False)`` at admission, ``allocate_slots`` per chunk or decode step,
    ``provide_token_ids`` when ids arrive (with the rolled-back watermark after drafts)."""

    def __init__(
        self, num_blocks: int, block_size: int, windows: Windows = (), watermark_blocks: int = 0
    ) -> None:
        kwargs: dict[str, Any] = {}
        if windows:
            kwargs["kv_groups"] = [
                pagedkv.FullAttention() if w is None else pagedkv.SlidingWindow(window=w) for w in windows
            ]
        self.num_groups = max(len(windows), 1)
        self.kv = pagedkv.KvCacheManager(
            num_blocks=num_blocks,
            block_size=block_size,
            enable_prefix_caching=True,
            watermark_blocks=watermark_blocks,
            **kwargs,
        )

    def match(self, tokens: list[int]) -> int:
        return int(self.kv.match_prefix(tokens))

    def admit(self, rid: int, tokens: list[int], num_scheduled: int) -> int | None:
        try:
            hit = int(self.kv.add_sequence(rid, tokens, num_scheduled=num_scheduled, reserve_prompt=False))
        except pagedkv.OutOfBlocksError:
            return None
        return hit

    def tables(self, rid: int) -> list[list[int | None]]:
        """Each group's block table; ``None`` where a window released the position (-1)."""
        if self.num_groups == 1:
            return [[int(b) for b in self.kv.block_table(rid)]]
        return [
            [None if b < 0 else int(b) for b in self.kv.block_table(rid, group=g).tolist()]
            for g in range(self.num_groups)
        ]

    def allocate(self, rid: int, num_tokens: int, lookahead: int = 0, in_flight: int = 0) -> bool:
        """Slots for a chunk or decode step (+ draft slots); False: refused, the preemption signal."""
        return bool(
            self.kv.allocate_slots(
                rid, num_tokens, num_lookahead_tokens=lookahead, num_in_flight_tokens=in_flight
            )
        )

    def provide(self, rid: int, token_ids: list[int], num_computed: int | None = None) -> None:
        """Ids of tokens after the known ones; ``num_computed``: the watermark after rejected drafts."""
        self.kv.provide_token_ids(rid, token_ids, num_computed_tokens=num_computed)

    def free(self, rid: int) -> None:
        self.kv.free(rid)

    def num_computed(self, rid: int) -> int:
        return int(self.kv.num_computed_tokens(rid))

    def in_use(self) -> int:
        return int(self.kv.num_blocks - self.kv.num_free_blocks)

    def check(self) -> None:
        self.kv.check_invariants()
