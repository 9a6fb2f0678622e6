"""A plain-Python reference of the paged replay for single-sequence requests (no groups, no prefix
caching, recompute preemption). It counts blocks with integers instead of driving a manager, so
it checks the Rust engine's schedule and accounting independently; the speed benchmark also uses
it as the plain-Python baseline."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass
class ReferenceResult:
    steps: int
    preemptions: int
    finished_requests: int
    generated_tokens: int
    prefill_tokens: int
    token_slots: int  # summed over steps
    reserved_slots: int
    internal_slots: int
    free_slots: int
    finished_order: list[int]


def replay_paged(
    prompt: np.ndarray,
    output: np.ndarray,
    *,
    block_size: int,
    num_slots: int,
    max_num_seqs: int = 256,
    watermark: float = 0.01,
) -> ReferenceResult:
    """Saturated arrivals; same step order as pagedkv::sim (decode with preemption, then admit)."""
    bs = block_size
    num_blocks = num_slots // bs
    watermark_blocks = math.ceil(watermark * num_blocks)
    prompts = [int(x) for x in prompt]
    outputs = [int(x) for x in output]
    waiting: deque[list[int]] = deque([i, 0] for i in range(len(prompts)))  # [request, generated]
    running: list[list[int]] = []
    free = num_blocks
    res = ReferenceResult(0, 0, 0, 0, 0, 0, 0, 0, 0, [])
    while waiting or running:
        # Decode: every running request needs a new block when its last block is full.
        need = sum(1 for r, g in running if (prompts[r] + g) % bs == 0)
        preempted = False
        while need > free:
            r, g = running.pop()
            t = prompts[r] + g
            free += math.ceil(t / bs)
            need -= t % bs == 0
            waiting.appendleft([r, g])
            res.preemptions += 1
            preempted = True
        for item in running:
            if (prompts[item[0]] + item[1]) % bs == 0:
                free -= 1
            item[1] += 1
            res.generated_tokens += 1
        if not preempted:
            while waiting and len(running) < max_num_seqs:
                r, g = waiting[0]
                blocks = math.ceil((prompts[r] + g + 1) / bs)
                if free < blocks or (running and free - blocks < watermark_blocks):
                    break
                waiting.popleft()
                free -= blocks
                res.prefill_tokens += prompts[r] + g
                running.append([r, g + 1])
                res.generated_tokens += 1
        for r, g in running:
            t = prompts[r] + g
            allocated = math.ceil(t / bs) * bs
            will_fill = min(prompts[r] + outputs[r], allocated)
            res.token_slots += t
            res.reserved_slots += will_fill - t
            res.internal_slots += allocated - will_fill
        res.free_slots += free * bs
        kept = []
        for r, g in running:
            if g >= outputs[r]:
                free += math.ceil((prompts[r] + g) / bs)
                res.finished_requests += 1
                res.finished_order.append(r)
            else:
                kept.append([r, g])
        running = kept
        res.steps += 1
    return res
