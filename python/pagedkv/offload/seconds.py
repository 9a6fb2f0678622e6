"""Durations the offload stores and the worker take (deadlines, timeouts, TTLs): one check.

A duration in seconds is a Python or NumPy ``int`` or ``float``, finite, at least zero (or above
zero where zero means nothing useful: a socket timeout, a TTL) and at most ``MAX_SECONDS``. The
upper bound is there because what consumes it has one: ``threading.Condition.wait`` raises
``OverflowError`` past ``threading.TIMEOUT_MAX`` (~292 years), a socket timeout past what a
``timeval`` holds, and Redis refuses a ``PX`` past 2**63 ms; ``math.isfinite(10**400)`` itself
raises ``OverflowError``. A typed error at the call beats any of those later, on another thread.
"""

from __future__ import annotations

import numbers

from pagedkv.errors import InvalidArgumentError, InvalidArgumentTypeError

__all__ = ["MAX_SECONDS", "seconds"]

MAX_SECONDS = 1e9
"""The longest duration accepted (~31.7 years): below every limit named above."""


def seconds(name: str, value: object, *, positive: bool = False) -> float:
    """``value`` as a float number of seconds, or a typed error naming ``name``: a wrong type is
    ``InvalidArgumentTypeError``; NaN, an infinity, a negative (or, with ``positive``, zero) or
    more than ``MAX_SECONDS`` is ``InvalidArgumentError``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentTypeError(f"{name} is a number of seconds, not {type(value).__name__}")
    least = "positive" if positive else "non-negative"
    error = InvalidArgumentError(
        f"{name} is a {least}, finite number of seconds, at most {MAX_SECONDS:g}: {value!r}"
    )
    try:
        # An integer is compared exactly, never converted first: float(10**400) overflows.
        number = int(value) if isinstance(value, numbers.Integral) else float(value)
    except OverflowError:  # a Fraction past the float range
        raise error from None
    if not ((number > 0 if positive else number >= 0) and number <= MAX_SECONDS):
        raise error  # NaN fails both comparisons; an infinity the second
    return float(number)
