#!/usr/bin/env python3
"""Golden outputs of llama.cpp for SmolLM2-135M-Instruct, the independent reference of tests/engine.

llama.cpp (through llama-cpp-python) is a tool to make the goldens, not a dependency of pagedkv.
Build it once in a venv outside the repository, for a CPU without AMX tile instructions:

    python3 -m venv /work/llamacpp-venv
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \\
        /work/llamacpp-venv/bin/pip install llama-cpp-python jinja2
    /work/llamacpp-venv/bin/python scripts/make_goldens.py MODEL.gguf tests/data/llamacpp_goldens.json

For each prompt (chat prompts rendered with the GGUF's own chat template through jinja2, as
pagedkv does): the prompt's token ids as llama.cpp tokenizes them (special tokens parsed, no BOS:
the file says add_bos_token = false), then the greedy continuation of STEPS tokens (EOS ignored)
with llama.cpp's top-5 token ids and logits at every step.
"""

from __future__ import annotations

import json
import sys

import numpy as np
from llamacpp_greedy import greedy_case

STEPS = 32
RAW = [
    "The capital of France is",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "In 1969, Apollo 11 landed on the Moon. 3.14159 is pi; 2^10 = 1024!",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Привет! Ça va? 日本語のテキスト — naïve café, ¿qué tal? 🚀",
]
CHAT = [
    "What is the capital of Germany?",
    "Write a haiku about the sea.",
    "How many legs does a spider have? Answer with a number.",
]
# One prompt over 1,000 tokens: a numbered list, so the model has something to continue.
LONG = (
    "Here is a list of facts, one per line.\n"
    + "".join(
        f"Fact {i}: the number {i} squared is {i * i}, and {i} plus {i} is {2 * i}.\n" for i in range(1, 61)
    )
    + "Fact 61:"
)


def chat_text(template: str, user: str) -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(
        messages=[{"role": "user", "content": user}], add_generation_prompt=True, bos_token="", eos_token=""
    )


def main() -> int:
    from llama_cpp import Llama

    model_path, out_path = sys.argv[1], sys.argv[2]
    llm = Llama(model_path=model_path, n_ctx=2048, logits_all=True, n_threads=2, n_batch=512, verbose=False)
    template = llm.metadata["tokenizer.chat_template"]
    prompts = [("raw", p) for p in RAW] + [("chat", chat_text(template, p)) for p in CHAT] + [("raw", LONG)]

    def last_logits() -> np.ndarray:
        return np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)

    cases = [
        greedy_case(
            llm,
            kind,
            text,
            llm.tokenize(text.encode("utf-8"), add_bos=False, special=True),
            STEPS,
            last_logits,
        )
        for kind, text in prompts
    ]
    with open(out_path, "w", encoding="utf-8") as handle:
        json.dump({"model": model_path.rsplit("/", 1)[-1], "steps": STEPS, "cases": cases}, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
