"""EngineConfig: the pool, the scheduler's knobs and the reservation policy of one engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["EngineConfig"]


@dataclass(frozen=True)
class EngineConfig:
    num_blocks: int = 512
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_host_blocks: int = 0
    preemption: Literal["recompute", "swap"] = "recompute"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 256  # rows per forward pass (decode rows + prefill chunks)
    enable_chunked_prefill: bool = True
    # "paged": blocks on demand. "contiguous": also admit only while every running sequence can
    # reserve max_model_len slots (the contiguous-reservation baseline on the same KV memory).
    reservation: Literal["paged", "contiguous"] = "paged"
    max_model_len: int | None = None  # default: the model's context length
    # Free blocks an admission must leave for the running sequences' next appends (default: 1% of
    # the pool), so that admitting does not force an immediate preemption.
    admission_watermark_blocks: int | None = None
