"""Errors raised while loading a model (a bad path, a truncated or malformed GGUF file, an
architecture / quantization this package does not implement) or rendering its chat template."""

from __future__ import annotations

from pagedkv.errors import InvalidArgumentError, PagedKvError

__all__ = ["ChatTemplateError", "ModelLoadError", "UnsupportedModelError"]


class ModelLoadError(PagedKvError):
    """The model file cannot be read: missing, not GGUF, truncated, or missing a required key."""


class UnsupportedModelError(InvalidArgumentError):
    """The GGUF file is valid but names an architecture or tensor type that is not supported."""


class ChatTemplateError(PagedKvError):
    """The model's chat template cannot render these messages: a syntax error, an undefined
    value, a sandbox violation, ``raise_exception`` called by the template, or a render past its
    time, loop or size budget (``pagedkv.models.chat_template``)."""
