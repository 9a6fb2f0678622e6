"""Text a tokenizer cannot take (a lone surrogate, which no UTF-8 encodes; a non-``str``) is an
``InvalidArgumentError`` from ``tokenizer.encode``, ``LLM.generate`` and ``LLM.stream``, not the
``tokenizers`` library's bare ``TypeError`` ("TextInputSequence must be str"). On the tiny GGUF
llama (tests/hardening/tiny_gguf.py: a real byte-level BPE tokenizer)."""

from __future__ import annotations

import pytest

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from pagedkv.engine import LLM, SamplingParams  # noqa: E402
from pagedkv.errors import InvalidArgumentError  # noqa: E402
from pagedkv.models import load_model  # noqa: E402
from tiny_gguf import write_tiny_llama  # noqa: E402

HOSTILE_TEXT = ["\ud800abc", "abc\udfff", "a\udc80b", "\ud83d"]  # the last: half of an emoji's pair


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGEDKV_CACHE_DIR", "off")  # the tiny model must not land in the user's cache
        model = load_model(write_tiny_llama(tmp_path_factory.mktemp("tiny") / "t.gguf"))
    return LLM(model)


@pytest.mark.parametrize("text", HOSTILE_TEXT)
def test_a_lone_surrogate_is_an_invalid_argument(tiny_llm: LLM, text: str) -> None:
    params = SamplingParams(max_tokens=2, temperature=0)
    with pytest.raises(InvalidArgumentError, match="surrogate"):
        tiny_llm.tokenizer.encode(text)
    with pytest.raises(InvalidArgumentError, match="surrogate"):
        tiny_llm.generate(text, params)
    with pytest.raises(InvalidArgumentError, match="surrogate"):
        tiny_llm.generate(["abc", text], params)  # every prompt is checked before any runs
    with pytest.raises(InvalidArgumentError, match="surrogate"):
        tiny_llm.generate(text, params, use_chat_template=True)
    with pytest.raises(InvalidArgumentError, match="surrogate"):
        next(iter(tiny_llm.stream(text, params)))
    # A pair (a real emoji) and ordinary text still run.
    assert tiny_llm.tokenizer.encode("\U0001f600abc")
    (out,) = tiny_llm.generate("abc", params)
    assert len(out.outputs[0].token_ids) >= 1


@pytest.mark.parametrize("text", [b"abc", 3, None, ["a"]])
def test_encode_of_a_non_str_is_an_invalid_argument(tiny_llm: LLM, text: object) -> None:
    with pytest.raises(InvalidArgumentError, match="is a str"):
        tiny_llm.tokenizer.encode(text)  # type: ignore[arg-type]


def test_the_gemma3_tokenizer_refuses_them_too() -> None:
    from pagedkv.models.gemma3.tokenizer import Gemma3Tokenizer

    # A minimal SPM vocabulary: control tokens, three pieces, the space symbol, byte fallback.
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "a", "b", "ab", "\u2581"]
    tokens += [f"<0x{i:02X}>" for i in range(256)]
    types = [3, 3, 3, 2, 1, 1, 1, 1] + [6] * 256
    tokenizer = Gemma3Tokenizer(
        {
            "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [0.0] * len(tokens),
            "tokenizer.ggml.token_type": types,
        }
    )
    assert tokenizer.encode("ab") == [6]
    for text in HOSTILE_TEXT:
        with pytest.raises(InvalidArgumentError, match="surrogate"):
            tokenizer.encode(text)
    with pytest.raises(InvalidArgumentError, match="is a str"):
        tokenizer.encode(b"ab")  # type: ignore[arg-type]
