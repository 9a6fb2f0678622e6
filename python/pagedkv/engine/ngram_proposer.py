"""Prompt-lookup drafts for speculative decoding: the tokens that followed the latest earlier
occurrence of the context's last n tokens, for n from ``max_ngram`` down to 1.

Text that repeats its own context (code edits, quoting, lists, retrieval answers) is continued
the way it went before; no draft model is needed. The longest suffix with an earlier match wins
(a longer match is a stronger predictor); among its occurrences the latest, the closest context.
"""

from __future__ import annotations

import numpy as np

__all__ = ["MAX_NGRAM", "propose_ngram_drafts"]

MAX_NGRAM = 3  # the longest suffix looked up (vLLM's prompt_lookup_max is of this order)


def propose_ngram_drafts(context: list[int], num_drafts: int, max_ngram: int = MAX_NGRAM) -> list[int]:
    """Up to ``num_drafts`` tokens predicted to follow ``context`` (empty when no suffix of it
    occurred earlier, or ``num_drafts`` is 0)."""
    if num_drafts <= 0 or len(context) < 2:
        return []
    tokens = np.asarray(context, dtype=np.int64)
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), 0, -1):
        suffix = tokens[length - n :]
        # Windows starting at 0 .. length - n - 1: every earlier occurrence, none being the suffix
        # itself; a match at i is followed by tokens[i + n], which exists.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + num_drafts].tolist()
    return []
