"""SamplingParams: how one request is sampled (the fields vLLM users know)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedkv.errors import InvalidArgumentError

__all__ = ["SamplingParams"]


@dataclass(frozen=True)
class SamplingParams:
    """n samples of at most max_tokens tokens each.

    temperature 0 is greedy (argmax); otherwise logits / temperature, restricted to the top_k
    tokens (0 = all) and to the smallest set whose probability reaches top_p, sampled with a
    generator seeded ``seed + i`` for sample i (so sample i of an ``n``-sample request equals a
    single-sample request with seed ``seed + i``). Generation stops at an end-of-generation token
    (unless ignore_eos), after max_tokens, or when the text contains one of ``stop``.
    """

    n: int = 1
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 16
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        def integer(name: str, value: object, low: int) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidArgumentError(
                    f"SamplingParams.{name} must be an integer >= {low}, got {value!r}"
                )

        integer("n", self.n, 1)
        integer("max_tokens", self.max_tokens, 1)
        integer("top_k", self.top_k, 0)
        if self.seed is not None:
            integer("seed", self.seed, 0)
        for name, value, low, high in (
            ("temperature", self.temperature, 0.0, 100.0),
            ("top_p", self.top_p, 0.0, 1.0),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise InvalidArgumentError(f"SamplingParams.{name} must be a finite number, got {value!r}")
            if not low <= value <= high or (name == "top_p" and value == 0.0):
                raise InvalidArgumentError(f"SamplingParams.{name} out of range: {value!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise InvalidArgumentError(f"SamplingParams.stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
