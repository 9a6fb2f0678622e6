"""SmolLM2-135M-Instruct against llama.cpp (tests/data/llamacpp_goldens.json, made by
scripts/make_goldens.py with llama-cpp-python): the same prompt token ids, and teacher-forced
logits on llama.cpp's own greedy continuation.

Tolerances: llama.cpp multiplies Q4_1 weights by activations quantized to 8 bits, our weights
are dequantized to fp32 and activations stay fp32, so logits differ (measured with
llama-cpp-python 0.3.36, CPU AVX2 build: at most 0.75 over llama.cpp's top-5 ids of all 288
steps; our argmax equal to llama.cpp's greedy token at 283 of 288 steps, the other 5 at near ties).
At every step our argmax must be llama.cpp's greedy token, or llama.cpp's own top-2 must be within
ARGMAX_MARGIN of each other (a near tie that 8-bit activations can flip). MAX_LOGIT_DIFF bounds the
difference on llama.cpp's top-5 ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

GOLDENS = Path(__file__).resolve().parents[1] / "data" / "llamacpp_goldens.json"
ARGMAX_MARGIN = 0.5
MAX_LOGIT_DIFF = 2.0


class _DenseCausal:
    """Dense causal attention for one sequence (a fast, independent path for long prompts; the
    paged caches are checked against contiguous KV bit for bit in test_llm_engine.py)."""

    def attend(self, layer, q, k, v):
        t, hq, d = q.shape
        group = hq // k.shape[1]
        kr, vr = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        # batched matmul (BLAS) rather than einsum: the 1,896-token case dominates this test
        scores = (q.transpose(1, 0, 2) @ kr.transpose(1, 2, 0)) / np.sqrt(d)
        scores[:, np.triu(np.ones((t, t), bool), 1)] = -np.inf
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        return (probs @ vr.transpose(1, 0, 2)).transpose(1, 0, 2).astype(np.float32)


@pytest.fixture(scope="module")
def goldens():
    if not GOLDENS.is_file():
        pytest.fail(f"{GOLDENS} is missing: run scripts/make_goldens.py")
    return json.loads(GOLDENS.read_text())


def test_goldens_cover_the_required_prompts(goldens):
    cases = goldens["cases"]
    assert len(cases) >= 8 and goldens["steps"] >= 32
    assert {c["kind"] for c in cases} == {"raw", "chat"}
    assert max(len(c["prompt_ids"]) for c in cases) > 1000
    assert any(any(ch.isdigit() for ch in c["text"]) for c in cases)
    assert any(any(ord(ch) > 127 for ch in c["text"]) for c in cases)


def test_prompt_token_ids_equal_llamacpp(smollm, goldens):
    for case in goldens["cases"]:
        assert smollm.tokenizer.encode(case["text"]) == case["prompt_ids"], case["text"][:40]


def test_teacher_forced_logits_match_llamacpp(smollm, goldens):
    model = smollm.model
    agree = total = 0
    worst = 0.0
    for case in goldens["cases"]:
        prompt, greedy = case["prompt_ids"], case["greedy_ids"]
        tokens = np.array(prompt + greedy[:-1])
        rows = np.arange(len(prompt) - 1, len(tokens))
        logits = model.forward(tokens, np.arange(len(tokens)), _DenseCausal(), rows)
        for step, row in zip(case["steps"], logits, strict=True):
            top_ids, top_logits = step["top_ids"], np.array(step["top_logits"])
            worst = max(worst, float(np.max(np.abs(row[top_ids] - top_logits))))
            total += 1
            if int(np.argmax(row)) == top_ids[0]:
                agree += 1
            else:
                assert top_logits[0] - top_logits[1] < ARGMAX_MARGIN, (case["text"][:40], step)
    assert worst < MAX_LOGIT_DIFF
    assert agree >= 0.95 * total
    print(f"teacher-forced argmax agreement {agree}/{total}, max |logit diff| on top-5 {worst:.3f}")


def test_engine_greedy_tokens_equal_llamacpp(smollm, goldens):
    """The paged engine end to end, free-running greedy on the short prompts (8 tokens each).

    Free-running, one flipped near tie changes every later token, so the tokens must equal
    llama.cpp's up to a step where they differ, and there llama.cpp's own top-2 must be within
    ARGMAX_MARGIN and ours must be llama.cpp's second choice (measured: "The capital of France is"
    flips at step 5, where llama.cpp's top-2 gap is 0.27)."""
    from pagedkv.engine import LLM, SamplingParams

    cases = [c for c in goldens["cases"] if len(c["prompt_ids"]) < 64][:3]
    llm = LLM(smollm, num_blocks=64, block_size=16)
    outs = llm.generate([c["prompt_ids"] for c in cases], SamplingParams(max_tokens=8, ignore_eos=True))
    exact = 0
    for case, out in zip(cases, outs, strict=True):
        ours = out.outputs[0].token_ids
        for step, (token, gold) in enumerate(zip(ours, case["steps"][:8], strict=True)):
            if token == gold["top_ids"][0]:
                continue
            gap = gold["top_logits"][0] - gold["top_logits"][1]
            assert gap < ARGMAX_MARGIN and token == gold["top_ids"][1], (case["text"][:40], step, token, gold)
            break  # past the flipped near tie the two continuations are different texts
        exact += ours == case["greedy_ids"][:8]
    assert exact >= 1
