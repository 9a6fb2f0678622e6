"""SmolLM2 in the ``quantized`` weight mode (the file's codes, fp32 arithmetic) and in the fp32
reference mode, loaded once per test process (skips the test when the model or the ``model``
extra is absent)."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest


@cache
def _load() -> tuple[Any, Any] | str:
    from pagedkv.models import ModelLoadError, load_model
    from pagedkv.models.llama import LlamaModel

    try:
        loaded = load_model()
    except ModelLoadError as error:
        return f"default model not installed: {error}"
    weights = loaded.model.weights
    return LlamaModel(weights, weights="quantized"), LlamaModel(weights, weights="fp32")


def smollm2_and_fp32_twin() -> tuple[Any, Any]:
    """``(model in quantized mode, the same weights in fp32 mode)``."""
    pytest.importorskip("gguf")
    pair = _load()
    if isinstance(pair, str):
        pytest.skip(pair)
    return pair
