"""The part both golden scripts (make_goldens.py for SmolLM2, make_gemma3_goldens.py for Gemma 3)
share: llama.cpp's greedy continuation of a prompt with its top-5 ids and logits at every step.
No pagedkv import: the scripts run in a venv that has llama-cpp-python and nothing of ours."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def greedy_case(
    llm: Any, kind: str, text: str, ids: list[int], steps: int, last_logits: Callable[[], np.ndarray]
):
    """Evaluate ``ids`` from an empty context, then ``steps`` greedy tokens (EOS ignored);
    ``last_logits()`` reads the logits after the latest token (how depends on ``logits_all``)."""
    llm.reset()
    llm.eval(ids)
    records = []
    for _ in range(steps):
        logits = last_logits()
        top = np.argsort(-logits)[:5]
        records.append({"top_ids": top.tolist(), "top_logits": logits[top].tolist()})
        llm.eval([int(top[0])])
    case = {
        "kind": kind,
        "text": text,
        "prompt_ids": list(ids),
        "greedy_ids": [s["top_ids"][0] for s in records],
        "steps": records,
    }
    print(f"{kind} prompt of {len(ids)} tokens: {llm.detokenize(case['greedy_ids'])[:60]!r}")
    return case
