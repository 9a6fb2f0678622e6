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

import numpy as np
import pytest
from llamacpp_golden_checks import (
    DenseAttention,
    check_engine_greedy_tokens,
    load_goldens,
    teacher_forced_logits,
)

ARGMAX_MARGIN = 0.5
MAX_LOGIT_DIFF = 2.0


@pytest.fixture(scope="module")
def goldens():
    return load_goldens("llamacpp_goldens.json", "scripts/make_goldens.py")


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
        logits = teacher_forced_logits(model, case, DenseAttention())
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
    """Measured: "The capital of France is" flips at step 5, where llama.cpp's top-2 gap is 0.27."""
    check_engine_greedy_tokens(smollm, goldens, ARGMAX_MARGIN)
