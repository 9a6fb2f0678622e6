"""Prompt token ids as the engine takes them: real integers only.

``int()`` would take ``1.9`` (as 1), ``'5'`` (as 5) and ``True`` (as 1), and NumPy would take NaN
or a masked array's hidden values; a prompt is refused instead, so that the tokens the model sees
are always the ones the caller meant. Accepted: a list or tuple of Python or NumPy integers, or a
one-dimensional NumPy integer array (not a masked one).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedkv.errors import InvalidArgumentError

__all__ = ["prompt_token_ids"]


def prompt_token_ids(prompt: Any, vocab_size: int) -> list[int]:
    """The prompt's token ids as Python ints; InvalidArgumentError unless every one is an integer
    in ``[0, vocab_size)`` and there is at least one."""
    if isinstance(prompt, np.ma.MaskedArray):
        raise InvalidArgumentError("a prompt must not be a masked array: its masked values would be used")
    if isinstance(prompt, np.ndarray):
        if prompt.ndim != 1 or prompt.dtype.kind not in "iu":
            raise InvalidArgumentError(
                f"a prompt array must be one-dimensional integers, got {prompt.ndim}-d {prompt.dtype}"
            )
        ids = prompt.tolist()
    elif isinstance(prompt, (list, tuple)):
        for t in prompt:
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
                raise InvalidArgumentError(f"a prompt's token ids must be integers, got {_clip(t)}")
        ids = [int(t) for t in prompt]
    else:
        raise InvalidArgumentError(
            f"a prompt must be a list of token ids or an integer array, got {type(prompt).__name__}"
        )
    if not ids:
        raise InvalidArgumentError("a prompt must have at least one token id")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidArgumentError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    return ids


def _clip(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."
