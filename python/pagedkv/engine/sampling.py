"""Choosing the next token from one row of logits."""

from __future__ import annotations

import numpy as np

from pagedkv.engine.params import SamplingParams

__all__ = ["sample_token"]


def sample_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """Greedy argmax at temperature 0; otherwise temperature, top-k, top-p, then one draw."""
    if params.greedy:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / params.temperature
    order = np.argsort(-scaled, kind="stable")
    if params.top_k:
        order = order[: params.top_k]
    kept = scaled[order]
    probs = np.exp(kept - kept[0])
    probs /= probs.sum()
    if params.top_p < 1.0:
        # The smallest prefix whose mass reaches top_p (always at least the top token).
        cut = int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1
        probs = probs[:cut] / probs[:cut].sum()
        order = order[:cut]
    return int(order[int(rng.choice(len(probs), p=probs))])
