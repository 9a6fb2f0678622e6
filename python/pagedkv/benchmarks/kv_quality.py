"""Quality of a KV-cache dtype: a text scored token by token through the engine's own data
plane (``PagedKvStore`` on ``KvCacheManager`` tables, the engine's KV layout), every score from
a decode step that reads the cache.

The text is teacher-forced: step t appends token t to the sequence, writes its K/V into the cache
(quantized on write) and attends its one query over every K/V the cache holds for positions
0..t, the earlier ones written, quantized and (int4) sealed by earlier steps; its logits score
token t + 1. So every score reads the quantized cache, as serving does when it decodes (a
prefill-only evaluation would attend over K/V that never went through the cache in engines that
quantize after attention). ``score_text`` returns the per-token negative log-likelihoods and
greedy choices; ``compare`` turns two runs into the perplexity change and the greedy agreement
(the share of positions where both choose the same next token).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedkv.engine.kv_budget import has_residual
from pagedkv.engine.kv_layout import kv_layout, layer_windows, new_manager
from pagedkv.engine.kv_store import PagedKvStore
from pagedkv.errors import InvalidArgumentError

__all__ = ["TextScore", "compare", "score_text"]


@dataclass(frozen=True)
class TextScore:
    """``nll[i]``: -log p(token i + 1 | tokens 0..i); ``greedy[i]``: the argmax at that step."""

    kv_cache_dtype: str
    nll: np.ndarray
    greedy: np.ndarray
    seconds: float

    @property
    def perplexity(self) -> float:
        return math.exp(float(np.mean(self.nll)))


def _log_softmax_at(logits: np.ndarray, index: int) -> float:
    row = logits.astype(np.float64)
    top = float(row.max())
    return float(row[index] - top - math.log(float(np.exp(row - top).sum())))


def score_text(
    model: Any,
    token_ids: list[int],
    kv_cache_dtype: str,
    *,
    block_size: int = 16,
    backend: str | None = None,
    progress: Any = None,
) -> TextScore:
    """Scores ``token_ids[1:]`` with decode steps over a ``kv_cache_dtype`` cache (module docs)."""
    n = len(token_ids)
    if n < 2 or n > model.config.max_model_len:
        raise InvalidArgumentError(
            f"a text of {n} tokens: score_text needs 2 to {model.config.max_model_len} (the model's context)"
        )
    layout = kv_layout(layer_windows(model.config))
    blocks = layout.num_groups * -(-n // block_size) + 1
    kv = new_manager(layout, num_blocks=blocks, block_size=block_size)
    store = PagedKvStore(
        model.config,
        blocks,
        block_size,
        backend=backend,
        layout=layout,
        kv_cache_dtype=kv_cache_dtype,
        num_residual_slots=1 if has_residual(kv_cache_dtype) else 0,
    )
    slots = np.zeros(1, np.int32) if has_residual(kv_cache_dtype) else None
    nll = np.empty(n - 1, np.float64)
    greedy = np.empty(n - 1, np.int64)
    start = time.perf_counter()
    kv.add_sequence(0, np.array(token_ids[:1], np.int64))
    for t in range(n - 1):
        if t:
            kv.append_tokens(0, np.array([token_ids[t]], np.int64))
        if layout.num_groups > 1:
            tables = [kv.batch_block_tables([0], group=g)[0] for g in range(layout.num_groups)]
        else:
            tables = [kv.batch_block_tables([0])[0]]
        store.set_batch(tables, np.array([t + 1], np.int32), np.ones(1, np.int32), slots)
        logits = model.model.forward(np.array([token_ids[t]]), np.array([t]), store, np.zeros(1, np.int64))[0]
        nll[t] = -_log_softmax_at(logits, token_ids[t + 1])
        greedy[t] = int(np.argmax(logits))
        if progress is not None and t and t % 1000 == 0:
            progress(f"{kv_cache_dtype}: {t}/{n - 1} tokens scored")
    return TextScore(kv_cache_dtype, nll, greedy, time.perf_counter() - start)


def compare(run: TextScore, baseline: TextScore) -> dict[str, float]:
    """``run`` against ``baseline`` on the same text: perplexities, the relative change, greedy
    agreement."""
    if run.nll.shape != baseline.nll.shape:
        raise InvalidArgumentError("compare needs two scores of the same text")
    return {
        "perplexity": run.perplexity,
        "baseline_perplexity": baseline.perplexity,
        "perplexity_change": run.perplexity / baseline.perplexity - 1.0,
        "greedy_agreement": float(np.mean(run.greedy == baseline.greedy)),
        "seconds": run.seconds,
    }
