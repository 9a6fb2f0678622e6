"""What the two llama.cpp golden suites (SmolLM2 in test_llamacpp_goldens.py, Gemma 3 in
test_gemma3_goldens.py) check the same way: an independent dense attention path for the
teacher-forced logits, the goldens file, and the free-running engine check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

DATA = Path(__file__).resolve().parents[1] / "data"


class DenseAttention:
    """Dense causal attention for one sequence, restricted to the last ``window`` keys where the
    model passes one (Gemma 3's local layers). A fast, independent path for long prompts: the
    paged caches are checked against contiguous KV bit for bit in the models' own tests."""

    def __init__(self, *, ignore_window: bool = False) -> None:
        self.ignore_window = ignore_window

    def attend(self, layer, q, k, v, window=None):
        t, hq, d = q.shape
        group = hq // k.shape[1]
        kr, vr = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        # batched matmul (BLAS) rather than einsum: the long cases dominate these tests
        scores = (q.transpose(1, 0, 2) @ kr.transpose(1, 2, 0)) / np.sqrt(d)
        pos = np.arange(t)
        hidden = pos[None, :] > pos[:, None]
        if window is not None and not self.ignore_window:
            hidden |= pos[None, :] <= pos[:, None] - window  # keys before p - window + 1
        scores[:, hidden] = -np.inf
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        return (probs @ vr.transpose(1, 0, 2)).transpose(1, 0, 2).astype(np.float32)


def load_goldens(name: str, script: str) -> dict[str, Any]:
    path = DATA / name
    if not path.is_file():
        pytest.fail(f"{path} is missing: run {script}")
    return json.loads(path.read_text())


def teacher_forced_logits(model, case: dict[str, Any], attention: DenseAttention) -> np.ndarray:
    """Our logits at every golden step: the prompt plus llama.cpp's greedy tokens in one pass."""
    prompt, greedy = case["prompt_ids"], case["greedy_ids"]
    tokens = np.array(prompt + greedy[:-1])
    rows = np.arange(len(prompt) - 1, len(tokens))
    return model.forward(tokens, np.arange(len(tokens)), attention, rows)


def check_engine_greedy_tokens(loaded, goldens: dict[str, Any], argmax_margin: float) -> None:
    """The paged engine end to end, free-running greedy on the short prompts (8 tokens each).

    Free-running, one flipped near tie changes every later token, so the tokens must equal
    llama.cpp's up to a step where they differ, and there llama.cpp's own top-2 must be within
    ``argmax_margin`` and ours must be llama.cpp's second choice."""
    from pagedkv.engine import LLM, SamplingParams

    cases = [c for c in goldens["cases"] if len(c["prompt_ids"]) < 64][:3]
    llm = LLM(loaded, num_blocks=64, block_size=16)
    # The engine takes token ids as the prompt (BOS included where the file adds one).
    outs = llm.generate([c["prompt_ids"] for c in cases], SamplingParams(max_tokens=8, ignore_eos=True))
    exact = 0
    for case, out in zip(cases, outs, strict=True):
        ours = out.outputs[0].token_ids
        for step, (token, gold) in enumerate(zip(ours, case["steps"][:8], strict=True)):
            if token == gold["top_ids"][0]:
                continue
            gap = gold["top_logits"][0] - gold["top_logits"][1]
            assert gap < argmax_margin and token == gold["top_ids"][1], (case["text"][:40], step, token, gold)
            break  # past the flipped near tie the two continuations are different texts
        exact += ours == case["greedy_ids"][:8]
    assert exact >= 1
