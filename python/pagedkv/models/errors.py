"""Errors raised while loading a model: a bad path, a truncated or malformed GGUF file, or an
architecture / quantization this package does not implement."""

from __future__ import annotations

from pagedkv.errors import InvalidArgumentError, PagedKvError

__all__ = ["ModelLoadError", "UnsupportedModelError"]


class ModelLoadError(PagedKvError):
    """The model file cannot be read: missing, not GGUF, truncated, or missing a required key."""


class UnsupportedModelError(InvalidArgumentError):
    """The GGUF file is valid but names an architecture or tensor type that is not supported."""
