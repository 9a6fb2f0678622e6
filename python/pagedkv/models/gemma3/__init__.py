"""Gemma 3 (``general.architecture = gemma3``: Gemma 3 270M): its hyperparameters (``config``),
the GGUF file reader (``file``), the SentencePiece-style tokenizer (``tokenizer``), where the
model package is installed (``locate``) and the forward pass with sliding-window layers
(``model``)."""

from __future__ import annotations

from pagedkv.models.gemma3.config import Gemma3Config
from pagedkv.models.gemma3.file import Gemma3File, Gemma3LayerWeights, read_gemma3_config, read_gemma3_gguf
from pagedkv.models.gemma3.locate import GEMMA3_MODEL_NAME, GEMMA3_PACKAGE, gemma3_model_path
from pagedkv.models.gemma3.model import Gemma3Model, WindowedKvAttention, gelu_tanh, rotary_half
from pagedkv.models.gemma3.tokenizer import Gemma3Tokenizer

__all__ = [
    "GEMMA3_MODEL_NAME",
    "GEMMA3_PACKAGE",
    "Gemma3Config",
    "Gemma3File",
    "Gemma3LayerWeights",
    "Gemma3Model",
    "Gemma3Tokenizer",
    "WindowedKvAttention",
    "gelu_tanh",
    "gemma3_model_path",
    "read_gemma3_config",
    "read_gemma3_gguf",
    "rotary_half",
]
