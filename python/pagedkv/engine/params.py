"""SamplingParams: how one request is sampled (the fields vLLM users know).

Every field is checked strictly when the params are made: exact types (a bool is not a number, a
float is not a count), finite numbers, ranges. ``stop=None`` means no stop strings, a single
string is one stop string.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from pagedkv.errors import InvalidArgumentError

__all__ = ["MAX_TEMPERATURE", "SamplingParams"]

MAX_TEMPERATURE = 100.0
MAX_SEED = 2**64  # exclusive, as NumPy's generators and the CLI's --seed take it


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
    stop: tuple[str, ...] | None = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        def integer(name: str, value: object, low: int, high: int | None = None) -> int:
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
                raise InvalidArgumentError(f"SamplingParams.{name} must be an integer, got {value!r}")
            if value < low or (high is not None and value >= high):
                bound = f">= {low}" if high is None else f"in [{low}, {high})"
                raise InvalidArgumentError(f"SamplingParams.{name} must be {bound}, got {value!r}")
            return int(value)

        def number(name: str, value: object) -> float:
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
                raise InvalidArgumentError(f"SamplingParams.{name} must be a number, got {value!r}")
            try:
                as_float = float(value)
            except (OverflowError, TypeError, ValueError) as error:  # 10**400, complex
                raise InvalidArgumentError(
                    f"SamplingParams.{name} must be a finite number, got {value!r}"
                ) from error
            if not math.isfinite(as_float):
                raise InvalidArgumentError(f"SamplingParams.{name} must be a finite number, got {value!r}")
            return as_float

        set_field = object.__setattr__  # frozen: store the normalized values
        set_field(self, "n", integer("n", self.n, 1))
        set_field(self, "max_tokens", integer("max_tokens", self.max_tokens, 1))
        set_field(self, "top_k", integer("top_k", self.top_k, 0))
        if self.seed is not None:
            set_field(self, "seed", integer("seed", self.seed, 0, MAX_SEED))
        temperature = number("temperature", self.temperature)
        if not 0.0 <= temperature <= MAX_TEMPERATURE:
            raise InvalidArgumentError(
                f"SamplingParams.temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}"
            )
        set_field(self, "temperature", temperature)
        top_p = number("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise InvalidArgumentError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        set_field(self, "top_p", top_p)
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise InvalidArgumentError(f"SamplingParams.ignore_eos must be a bool, got {self.ignore_eos!r}")
        set_field(self, "ignore_eos", bool(self.ignore_eos))
        set_field(self, "stop", _stop_strings(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _stop_strings(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)):
        raise InvalidArgumentError(f"SamplingParams.stop must be a string or a list of strings, got {stop!r}")
    for s in stop:
        if not isinstance(s, str) or not s:
            raise InvalidArgumentError(f"SamplingParams.stop must be non-empty strings, got {s!r}")
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as error:  # a lone surrogate can never appear in decoded text
            raise InvalidArgumentError(f"SamplingParams.stop {s!r} is not valid text: {error}") from error
    return tuple(stop)
