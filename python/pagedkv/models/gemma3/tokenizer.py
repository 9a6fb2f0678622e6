"""The SentencePiece-style tokenizer of a Gemma 3 GGUF file (``tokenizer.ggml.model = llama``),
built with the ``tokenizers`` library from the file's metadata to tokenize as llama.cpp does.

llama.cpp's SPM tokenizer (``llm_tokenizer_spm``) first cuts the text at special tokens: control
tokens (type 3, e.g. ``<start_of_turn>``) when special tokens are parsed, user-defined tokens
(type 4: Gemma's runs of newlines and tabs, HTML tags) always, longest match first. Each remaining
piece has its spaces replaced by ``▁`` (U+2581; no space is prepended: ``add_space_prefix`` is
false) and is split into characters, and adjacent symbols are merged, highest token score first,
while their concatenation is a token; a character no token covers becomes its UTF-8 bytes
(``<0xXX>``, type 6). That is BPE whose merges are every split (left, right) of a token into two
tokens, ranked by the merged token's score, with byte fallback and no pre-tokenizer; this module
builds exactly that. BOS is prepended when ``tokenizer.ggml.add_bos_token`` says so.

The Gemma 3 270M file has no ``tokenizer.chat_template``; its turns are then rendered with the
Gemma format llama.cpp falls back to for this architecture (``<start_of_turn>user\\n...
<end_of_turn>\\n``, the assistant's role named ``model``, a system message prefixed to the first
user turn).
"""

from __future__ import annotations

from typing import Any

from pagedkv.errors import ModelLoadError, UnsupportedModelError
from pagedkv.models.chat_template import render_chat_template
from pagedkv.models.text import TokenizerText

__all__ = ["GEMMA_CHAT_TEMPLATE", "Gemma3Tokenizer"]

_NORMAL, _CONTROL, _USER_DEFINED, _BYTE = 1, 3, 4, 6
_SPACE = "\u2581"
# The Gemma turn format (what llama.cpp renders for a Gemma model without a template of its own).
GEMMA_CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + (message['content'] | trim) + '\n\n' -%}"
    "{%- else -%}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{{- ns.system + (message['content'] | trim) + '<end_of_turn>\n' -}}"
    "{%- set ns.system = '' -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every split of a normal token into two tokens, the highest-scoring merged token first (ties:
    the lower token id first)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for i, token in enumerate(tokens):
        if types[i] != _NORMAL or len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-float(scores[i]), i, left, right))
    ranked.sort(key=lambda r: (r[0], r[1]))
    return [(left, right) for _, _, left, right in ranked]


class Gemma3Tokenizer(TokenizerText):
    """encode/decode as llama.cpp does for Gemma 3's SentencePiece vocabulary."""

    def __init__(self, metadata: dict[str, Any]) -> None:
        from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

        kind = metadata.get("tokenizer.ggml.model")
        if kind != "llama":
            raise UnsupportedModelError(f"unsupported tokenizer model {kind!r}: Gemma 3 uses 'llama' (SPM)")
        if metadata.get("tokenizer.ggml.add_space_prefix", False):
            raise UnsupportedModelError("add_space_prefix = true is not supported (Gemma 3 sets false)")
        try:
            tokens = [str(t) for t in metadata["tokenizer.ggml.tokens"]]
            scores = [float(s) for s in metadata["tokenizer.ggml.scores"]]
            types = [int(t) for t in metadata["tokenizer.ggml.token_type"]]
        except (KeyError, TypeError, ValueError) as error:
            raise ModelLoadError(f"GGUF tokenizer metadata incomplete: {error}") from error
        if not (len(tokens) == len(scores) == len(types)):
            raise ModelLoadError("tokenizer.ggml.tokens, scores and token_type differ in length")
        unk_id = int(metadata.get("tokenizer.ggml.unknown_token_id", 3))
        vocab = {t: i for i, t in enumerate(tokens)}
        model = models.BPE(
            vocab=vocab,
            merges=spm_merges(tokens, scores, types),
            unk_token=tokens[unk_id] if 0 <= unk_id < len(tokens) else None,
            fuse_unk=False,
            byte_fallback=True,
        )
        tokenizer = Tokenizer(model)
        tokenizer.normalizer = normalizers.Replace(" ", _SPACE)
        tokenizer.decoder = decoders.Sequence(
            [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        )
        tokenizer.add_special_tokens(
            [
                AddedToken(t, special=True, normalized=False)
                for t, k in zip(tokens, types, strict=True)
                if k == _CONTROL
            ]
        )
        tokenizer.add_tokens(
            [
                AddedToken(t, special=False, normalized=False)
                for t, k in zip(tokens, types, strict=True)
                if k == _USER_DEFINED
            ]
        )
        self._tokenizer = tokenizer
        self._tokens = tokens
        self.vocab_size = len(tokens)
        self.bos_token_id = int(metadata.get("tokenizer.ggml.bos_token_id", -1))
        self.eos_token_id = int(metadata.get("tokenizer.ggml.eos_token_id", -1))
        self.add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
        self.chat_template: str = str(metadata.get("tokenizer.chat_template") or GEMMA_CHAT_TEMPLATE)
        # llama.cpp's end-of-generation set for Gemma: EOS and the end of a turn.
        self.stop_token_ids = frozenset(
            i for i, t in enumerate(tokens) if i == self.eos_token_id or t == "<end_of_turn>"
        )

    def apply_chat_template(
        self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        """The prompt text for ``messages`` ([{"role": ..., "content": ...}]) by the file's template
        (GEMMA_CHAT_TEMPLATE when it has none), rendered in a sandbox with bounded time and size
        as llama's (``chat_template``: the file's template is untrusted); ChatTemplateError when
        the template fails. No BOS: ``encode`` adds it."""
        context = {
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": "",
            "eos_token": "",
        }
        return render_chat_template(self.chat_template, context)
