"""A request and its sequences (one per sample): the state the scheduler moves between queues."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from pagedkv.engine.params import SamplingParams

if TYPE_CHECKING:
    from pagedkv._core import PromptHashes

__all__ = ["Request", "Sequence", "SeqStatus"]


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # not in the KV manager: new, or preempted by recompute
    RUNNING = "running"
    SWAPPED = "swapped"  # its blocks are in the swap tier
    FINISHED = "finished"


@dataclass
class Request:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    arrival_s: float
    sequences: list[Sequence] = field(default_factory=list)
    first_token_s: float | None = None
    finish_s: float | None = None
    forked: bool = False  # the n samples exist (forked off sample 0 after its prefill)
    cached_tokens: int = 0  # prompt tokens served by the prefix cache at admission
    error: str | None = None  # set when the request failed inside a step

    @property
    def finished(self) -> bool:
        return self.forked and all(s.status is SeqStatus.FINISHED for s in self.sequences)


@dataclass
class Sequence:
    """One sample. ``token_ids`` = prompt + generated. How many of them the KV manager holds and
    how many have K/V (its computed watermark) is the manager's state, asked of it, never
    mirrored here. ``draft_ids``: the speculative tokens appended after ``token_ids`` for the
    coming pass (empty outside a speculative step)."""

    seq_id: int
    request: Request
    index: int  # sample index within the request
    token_ids: list[int]
    rng: np.random.Generator
    status: SeqStatus = SeqStatus.WAITING
    draft_ids: list[int] = field(default_factory=list)
    admitted: int = -1  # admission order (the most recent is preempted first)
    queue_rank: int = -1  # arrival rank in the cache-aware queue (engine/waiting_order.py)
    # The prompt's block hashes, computed once at arrival for the cache-aware queue and handed
    # to the admission (``add_sequence(..., prompt_hashes=...)``) so it does not hash them again;
    # a prefix of the hashes of ``token_ids`` however many tokens are generated. None under FCFS.
    prompt_hashes: PromptHashes | None = None
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    token_times_s: list[float] = field(default_factory=list)
