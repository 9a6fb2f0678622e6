"""What the engine reports: one event per new token while it runs, one output per request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedkv.engine.sequence import Request

__all__ = ["CompletionOutput", "RequestOutput", "StreamEvent", "request_output"]


@dataclass(frozen=True)
class StreamEvent:
    """One new token of one sample (``text`` is the newly decodable text, possibly empty).

    A request that failed inside a step ends each of its unfinished samples with one event of
    ``finish_reason="error"``, ``token_id=-1`` (no token) and the failure in ``error``."""

    request_id: int
    index: int
    token_id: int
    text: str
    finished: bool
    finish_reason: str | None
    error: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    ttft_s: float | None  # arrival to first token
    tpot_s: float | None  # mean time per output token after the first
    num_cached_tokens: int
    error: str | None = None  # why the request failed inside a step (finish_reason "error")
    # kv_role="prefill": the params the decode side reads the prompt's K/V with (JSON-safe).
    kv_transfer_params: dict[str, Any] | None = None


def request_output(r: Request) -> RequestOutput:
    """What ``r`` has produced so far (final once every sample finished)."""
    tpots = [
        (s.token_times_s[-1] - s.token_times_s[0]) / (len(s.token_times_s) - 1)
        for s in r.sequences
        if len(s.token_times_s) > 1
    ]
    return RequestOutput(
        request_id=r.request_id,
        prompt=None,
        prompt_token_ids=r.prompt_ids,
        outputs=[CompletionOutput(s.index, s.text, list(s.output_ids), s.finish_reason) for s in r.sequences],
        ttft_s=None if r.first_token_s is None else r.first_token_s - r.arrival_s,
        tpot_s=float(np.mean(tpots)) if tpots else None,
        num_cached_tokens=r.cached_tokens,
        error=r.error,
    )
