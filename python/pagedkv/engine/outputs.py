"""What the engine reports: one event per new token while it runs, one output per request."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CompletionOutput", "RequestOutput", "StreamEvent"]


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
