"""The text both tokenizers take (llama's and Gemma 3's), checked before ``tokenizers`` sees it,
and the calls both answer alike on their ``tokenizers`` object (``TokenizerText``)."""

from __future__ import annotations

from typing import Any

from pagedkv.errors import InvalidArgumentError

__all__ = ["TokenizerText", "checked_text"]


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


class TokenizerText:
    """``encode``, ``decode`` and ``token_text`` of a GGUF tokenizer built on the ``tokenizers``
    library (llama's ``GgufTokenizer``, ``Gemma3Tokenizer``); they differ in how they build it.
    A subclass sets ``_tokenizer``, ``_tokens``, ``bos_token_id`` and ``add_bos``."""

    _tokenizer: Any
    _tokens: list[str]
    bos_token_id: int
    add_bos: bool

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; control tokens written in the text are parsed as such; BOS is
        prepended only when the file says ``add_bos_token``."""
        ids = self._tokenizer.encode(checked_text(text), add_special_tokens=False).ids
        return [self.bos_token_id, *ids] if self.add_bos else list(ids)

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        return str(self._tokens[token_id])
