"""The tokenizer of a GGUF model, built with the ``tokenizers`` library from the file's metadata.

GGUF ``gpt2``-model vocabularies are byte-level BPE: the vocabulary (``tokenizer.ggml.tokens``,
already in GPT-2's byte-to-unicode alphabet), the merges, token types (3 = control tokens such as
``<|im_start|>``, parsed out of the text as in llama.cpp) and BOS/EOS ids. The pre-tokenizer is
the one llama.cpp selects by ``tokenizer.ggml.pre``: for ``smollm`` every digit is split off on its
own first (regex ``\\p{N}``), then GPT-2's byte-level regex applies. The chat template is the
file's ``tokenizer.chat_template`` rendered with jinja2 in a sandbox, as transformers does, with
the time and size bounds of ``chat_template``.
"""

from __future__ import annotations

from typing import Any

from pagedkv.errors import ModelLoadError, UnsupportedModelError
from pagedkv.models.chat_template import render_chat_template
from pagedkv.models.text import TokenizerText

__all__ = ["GgufTokenizer", "SUPPORTED_PRE_TOKENIZERS"]

# tokenizer.ggml.pre values whose regexes match GPT-2's byte-level split (after an optional digit
# split): llama.cpp's LLAMA_VOCAB_PRE_TYPE_GPT2 and _SMOLLM.
_DIGIT_SPLIT = {"smollm": True, "gpt2": False, "default": False}
SUPPORTED_PRE_TOKENIZERS = tuple(_DIGIT_SPLIT)
_CONTROL, _USER_DEFINED = 3, 4


def _vocabulary(metadata: dict[str, Any]) -> tuple[list[str], list[tuple[str, str]], list[int]]:
    """Tokens, merges and token types, checked: what ``tokenizers`` would silently accept
    (a duplicate token drops an id; a short type list mislabels control tokens) or refuse with a
    bare ``Exception`` is a ModelLoadError naming the entry."""
    tokens = metadata.get("tokenizer.ggml.tokens")
    raw_merges = metadata.get("tokenizer.ggml.merges")
    for key, value in (("tokens", tokens), ("merges", raw_merges)):
        if not isinstance(value, list) or not all(type(v) is str for v in value):
            raise ModelLoadError(f"GGUF metadata 'tokenizer.ggml.{key}' is missing or not a list of strings")
    assert isinstance(tokens, list) and isinstance(raw_merges, list)
    if not tokens:
        raise ModelLoadError("GGUF metadata 'tokenizer.ggml.tokens' is empty")
    seen: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if token in seen:
            raise ModelLoadError(f"GGUF vocabulary repeats token {token!r} (ids {seen[token]} and {i})")
        seen[token] = i
    merges: list[tuple[str, str]] = []
    for i, merge in enumerate(raw_merges):
        left, space, right = merge.partition(" ")
        if not space or not left or not right:
            raise ModelLoadError(f"GGUF merge #{i} {merge!r} is not two tokens separated by a space")
        for part in (left, right, left + right):
            if part not in seen:
                raise ModelLoadError(
                    f"GGUF merge #{i} {merge!r} uses {part!r}, which is not in the vocabulary"
                )
        merges.append((left, right))
    types = metadata.get("tokenizer.ggml.token_type", [1] * len(tokens))
    if not isinstance(types, list) or not all(type(t) is int for t in types):
        raise ModelLoadError("GGUF metadata 'tokenizer.ggml.token_type' is not a list of integers")
    if len(types) != len(tokens):
        raise ModelLoadError(
            f"GGUF metadata has {len(types)} token types for {len(tokens)} tokens (tokenizer.ggml.token_type)"
        )
    return tokens, merges, types


def _token_id(metadata: dict[str, Any], key: str, vocab_size: int) -> int:
    """A special token id: absent is -1; present must be an id of the vocabulary."""
    if key not in metadata:
        return -1
    value = metadata[key]
    if type(value) is not int or not 0 <= value < vocab_size:
        raise ModelLoadError(
            f"GGUF metadata {key!r} is {value!r}, not a token id (vocabulary of {vocab_size})"
        )
    return value


class GgufTokenizer(TokenizerText):
    """encode/decode exactly as llama.cpp does for the supported vocabularies."""

    def __init__(self, metadata: dict[str, Any]) -> None:
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

        kind = metadata.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise UnsupportedModelError(f"unsupported tokenizer model {kind!r}: only byte-level BPE ('gpt2')")
        pre = metadata.get("tokenizer.ggml.pre", "default")
        if type(pre) is not str or pre not in _DIGIT_SPLIT:
            raise UnsupportedModelError(
                f"unsupported pre-tokenizer {pre!r}: supported are {', '.join(SUPPORTED_PRE_TOKENIZERS)}"
            )
        tokens, merges, types = _vocabulary(metadata)
        vocab = {token: i for i, token in enumerate(tokens)}
        specials = [tokens[i] for i, t in enumerate(types) if t in (_CONTROL, _USER_DEFINED)]
        try:  # the checks above cover what the library refuses; this is the backstop
            tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
            tokenizer.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
        except Exception as error:
            raise ModelLoadError(f"GGUF tokenizer rejected: {error}") from error
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if _DIGIT_SPLIT[pre]:
            tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), byte_level]
            )
        else:
            tokenizer.pre_tokenizer = byte_level
        tokenizer.decoder = decoders.ByteLevel()
        self._tokenizer = tokenizer
        self.vocab_size = len(tokens)
        self.bos_token_id = _token_id(metadata, "tokenizer.ggml.bos_token_id", len(tokens))
        self.eos_token_id = _token_id(metadata, "tokenizer.ggml.eos_token_id", len(tokens))
        self.add_bos = metadata.get("tokenizer.ggml.add_bos_token", False)
        if type(self.add_bos) is not bool:
            raise ModelLoadError(
                f"GGUF metadata 'tokenizer.ggml.add_bos_token' is {self.add_bos!r}, expected a bool"
            )
        if self.add_bos and self.bos_token_id < 0:
            raise ModelLoadError("GGUF metadata asks for a BOS token (add_bos_token) but names none")
        template = metadata.get("tokenizer.chat_template")
        if template is not None and type(template) is not str:
            raise ModelLoadError(
                f"GGUF metadata 'tokenizer.chat_template' is a {type(template).__name__}, expected a string"
            )
        self.chat_template: str | None = template
        self._tokens = tokens
        # Control tokens the chat template closes a turn with also end generation (llama.cpp's EOG set).
        self.stop_token_ids = frozenset(
            i
            for i, t in enumerate(tokens)
            if i == self.eos_token_id
            or (types[i] == _CONTROL and t in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"))
        )

    def apply_chat_template(
        self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        """The prompt text for ``messages`` ([{"role": ..., "content": ...}]) by the file's template,
        rendered in a sandbox with bounded time and size (``chat_template``); ChatTemplateError
        when the template fails."""
        if not self.chat_template:
            raise UnsupportedModelError("this model has no chat template (tokenizer.chat_template)")
        bos = self._tokens[self.bos_token_id] if self.bos_token_id >= 0 else ""
        eos = self._tokens[self.eos_token_id] if self.eos_token_id >= 0 else ""
        context = {
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": bos,
            "eos_token": eos,
        }
        return render_chat_template(self.chat_template, context)
