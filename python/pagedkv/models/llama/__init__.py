"""The llama family (``general.architecture = llama``: SmolLM2, the default model): its
hyperparameters (``config``), the GGUF file reader (``file``), the byte-level BPE tokenizer
(``tokenizer``), where the default model is installed (``locate``) and the forward pass
(``model``)."""

from __future__ import annotations

from pagedkv.models.llama.config import LlamaConfig
from pagedkv.models.llama.file import GgufModel, LayerWeights, read_gguf
from pagedkv.models.llama.locate import DEFAULT_MODEL_FILE, DEFAULT_MODEL_PACKAGE, default_model_path
from pagedkv.models.llama.model import KvAttention, LlamaModel, rms_norm, rotary_interleaved
from pagedkv.models.llama.tokenizer import GgufTokenizer

__all__ = [
    "DEFAULT_MODEL_FILE",
    "DEFAULT_MODEL_PACKAGE",
    "GgufModel",
    "GgufTokenizer",
    "KvAttention",
    "LayerWeights",
    "LlamaConfig",
    "LlamaModel",
    "default_model_path",
    "read_gguf",
    "rms_norm",
    "rotary_interleaved",
]
