"""The text both tokenizers take (llama's and Gemma 3's): checked before ``tokenizers`` sees it."""

from __future__ import annotations

from pagedkv.errors import InvalidArgumentError

__all__ = ["checked_text"]


def checked_text(text: object) -> str:
    """``text`` if a tokenizer can take it, else ``InvalidArgumentError``: a ``str`` that is
    valid Unicode. ``tokenizers`` raises a bare ``TypeError`` ("TextInputSequence must be str")
    for a non-``str`` and for a lone surrogate (``"\\ud800"``: no UTF-8 encodes it)."""
    if not isinstance(text, str):
        raise InvalidArgumentError(f"text to tokenize is a str, not {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgumentError(
            f"text to tokenize is valid Unicode; position {exc.start} holds a lone surrogate "
            f"{text[exc.start]!r}"
        ) from None
    return text
