"""Choosing the next token from one row of logits."""

from __future__ import annotations

import numpy as np

from pagedkv.engine.params import SamplingParams

__all__ = ["sample_token"]


def sample_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """Greedy argmax at temperature 0; otherwise temperature, top-k, top-p, then one draw.

    The logits are shifted by their maximum before they are divided by the temperature: every
    scaled value is then <= 0 and the top one exactly 0, so that a temperature as small as
    5e-324 gives -inf (probability 0) to the others instead of inf - inf = NaN."""
    if params.greedy:
        return int(np.argmax(logits))
    order = np.argsort(-logits.astype(np.float64), kind="stable")
    if params.top_k:
        order = order[: params.top_k]
    kept = logits[order].astype(np.float64)
    with np.errstate(over="ignore", divide="ignore"):
        probs = np.exp((kept - kept[0]) / params.temperature)
    probs /= probs.sum()
    if params.top_p < 1.0:
        # The smallest prefix whose mass reaches top_p (always at least the top token).
        cut = int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1
        probs = probs[:cut] / probs[:cut].sum()
        order = order[:cut]
    return int(order[int(rng.choice(len(probs), p=probs))])
