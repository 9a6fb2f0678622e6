"""The tokenizer of a GGUF model, built with the ``tokenizers`` library from the file's metadata.

GGUF ``gpt2``-model vocabularies are byte-level BPE: the vocabulary (``tokenizer.ggml.tokens``,
already in GPT-2's byte-to-unicode alphabet), the merges, token types (3 = control tokens such as
``<|im_start|>``, parsed out of the text as in llama.cpp) and BOS/EOS ids. The pre-tokenizer is
the one llama.cpp selects by ``tokenizer.ggml.pre``: for ``smollm`` every digit is split off on its
own first (regex ``\\p{N}``), then GPT-2's byte-level regex applies. The chat template is the
file's ``tokenizer.chat_template`` rendered with jinja2 in a sandbox, as transformers does.
"""

from __future__ import annotations

from typing import Any

from pagedkv.models.errors import ModelLoadError, UnsupportedModelError

__all__ = ["GgufTokenizer", "SUPPORTED_PRE_TOKENIZERS"]

# tokenizer.ggml.pre values whose regexes match GPT-2's byte-level split (after an optional digit
# split): llama.cpp's LLAMA_VOCAB_PRE_TYPE_GPT2 and _SMOLLM.
_DIGIT_SPLIT = {"smollm": True, "gpt2": False, "default": False}
SUPPORTED_PRE_TOKENIZERS = tuple(_DIGIT_SPLIT)
_CONTROL, _USER_DEFINED = 3, 4


class GgufTokenizer:
    """encode/decode exactly as llama.cpp does for the supported vocabularies."""

    def __init__(self, metadata: dict[str, Any]) -> None:
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

        kind = metadata.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise UnsupportedModelError(f"unsupported tokenizer model {kind!r}: only byte-level BPE ('gpt2')")
        pre = metadata.get("tokenizer.ggml.pre", "default")
        if pre not in _DIGIT_SPLIT:
            raise UnsupportedModelError(
                f"unsupported pre-tokenizer {pre!r}: supported are {', '.join(SUPPORTED_PRE_TOKENIZERS)}"
            )
        try:
            tokens = list(metadata["tokenizer.ggml.tokens"])
            merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
        except (KeyError, TypeError) as error:
            raise ModelLoadError(f"GGUF tokenizer metadata incomplete: {error}") from error
        types = list(metadata.get("tokenizer.ggml.token_type", [1] * len(tokens)))
        vocab = {token: i for i, token in enumerate(tokens)}
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if _DIGIT_SPLIT[pre]:
            tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), byte_level]
            )
        else:
            tokenizer.pre_tokenizer = byte_level
        tokenizer.decoder = decoders.ByteLevel()
        specials = [tokens[i] for i, t in enumerate(types) if t in (_CONTROL, _USER_DEFINED)]
        tokenizer.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
        self._tokenizer = tokenizer
        self.vocab_size = len(tokens)
        self.bos_token_id = int(metadata.get("tokenizer.ggml.bos_token_id", -1))
        self.eos_token_id = int(metadata.get("tokenizer.ggml.eos_token_id", -1))
        self.add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
        self.chat_template: str | None = metadata.get("tokenizer.chat_template")
        self._tokens = tokens
        # Control tokens the chat template closes a turn with also end generation (llama.cpp's EOG set).
        self.stop_token_ids = frozenset(
            i
            for i, t in enumerate(tokens)
            if i == self.eos_token_id
            or (types[i] == _CONTROL and t in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"))
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; control tokens written in the text are parsed as such; BOS is
        prepended only when the file says ``add_bos_token``."""
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id, *ids] if self.add_bos else list(ids)

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        return str(self._tokens[token_id])

    def apply_chat_template(
        self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        """The prompt text for ``messages`` ([{"role": ..., "content": ...}]) by the file's template."""
        if not self.chat_template:
            raise UnsupportedModelError("this model has no chat template (tokenizer.chat_template)")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        template = env.from_string(self.chat_template)
        bos = self._tokens[self.bos_token_id] if 0 <= self.bos_token_id < len(self._tokens) else ""
        eos = self._tokens[self.eos_token_id] if 0 <= self.eos_token_id < len(self._tokens) else ""
        return str(
            template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos
            )
        )
