"""The GGUF loader against lying and malformed files (docs/security.md, "Model files").

Counts that run past the end of the file used to hang ``gguf.GGUFReader`` while memory grew;
they run here in child interpreters with a timeout and an address-space limit
(``gguf_isolated``), so that a regression fails these tests instead of hanging CI. The
metadata and tokenizer cases are quick and run in-process on the tiny model of ``tiny_gguf``.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
from gguf_isolated import run_load_cases
from tiny_gguf import OMIT, TOKENS, default_tensors, write_tiny_llama

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from pagedkv.models import load_model  # noqa: E402

ARRAY, STRING, UINT32 = 9, 8, 4


def gguf_header(*, version: int = 3, n_tensors: int = 0, n_kv: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def gguf_string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def array_bomb(element_type: int, count: int = 1 << 62) -> bytes:
    """One metadata entry: an array declaring ``count`` elements, with nothing after it."""
    return gguf_header(n_kv=1) + gguf_string(b"a") + struct.pack("<IIQ", ARRAY, element_type, count)


def count_offset(data: bytes, key: str) -> int:
    """Offset of the element count of the array under ``key`` in a file's bytes."""
    at = data.index(gguf_string(key.encode()))
    return at + 8 + len(key) + 4 + 4  # key, value type, element type


@pytest.fixture(autouse=True)
def no_weight_cache(monkeypatch):
    """These loads must not leave tiny entries in the user's cache."""
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", "off")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


def test_lying_counts_fail_fast_without_allocating(tiny, tmp_path):
    """Each of these hung the old loader (growing memory) or leaked an
    IndexError; each is now a ModelLoadError of its own, with no MemoryError behind it and no
    measurable memory growth."""
    base = tiny.read_bytes()
    cases = {
        "u32 array of 2**62": array_bomb(UINT32),
        "29-byte prefix": array_bomb(UINT32)[:29],
        "string array of 2**62": array_bomb(STRING),
        "nested array of 2**62": array_bomb(ARRAY),
        "u64 array of 2**64-1": array_bomb(10, (1 << 64) - 1),
        "unknown element type": array_bomb(99, 3),
        "2**62 metadata entries": gguf_header(n_kv=1 << 62),
        "2**62 tensors": gguf_header(n_tensors=1 << 62),
        "string length 2**63": gguf_header(n_kv=1) + struct.pack("<Q", 1 << 63) + b"key",
        "tensor past the end": base[: len(base) - 100],
    }
    specs = [[name, "bytes", data.hex()] for name, data in cases.items()]
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"):
        specs.append(
            [f"{key} count 2**62", "patch", count_offset(base, key), struct.pack("<Q", 1 << 62).hex()]
        )
    outcomes = run_load_cases(tiny, specs, tmp_path, timeout_s=60)
    for name, *_ in specs:
        result = outcomes[name]
        assert result.outcome == "ModelLoadError", (name, result)
        assert result.cause != "MemoryError", (name, result)
        assert result.peak_growth_kib < 64 << 10, (name, result)


def test_metadata_elements_are_capped_in_all(tmp_path, monkeypatch):
    """Each array element becomes a Python object: the total over all arrays is bounded, so a
    file of many honest-looking arrays cannot turn a few GB of bytes into tens of GB of lists."""
    from pagedkv.models import ModelLoadError, gguf_reader

    monkeypatch.setattr(gguf_reader, "MAX_METADATA_ELEMENTS", 1000)
    entry = gguf_string(b"k") + struct.pack("<IIQ", ARRAY, 0, 600) + bytes(600)  # 600 u8 elements
    one = tmp_path / "one.gguf"
    one.write_bytes(gguf_header(n_kv=1) + entry)
    assert gguf_reader.open_gguf(one).metadata["k"] == [0] * 600
    two = tmp_path / "two.gguf"
    two.write_bytes(gguf_header(n_kv=2) + entry + entry.replace(b"k", b"j", 1))
    with pytest.raises(ModelLoadError, match="more than 1000 elements in all"):
        gguf_reader.open_gguf(two)


def test_reader_matches_gguf_package(tiny):
    """The bounded reader sees what gguf.GGUFReader sees on a valid file."""
    from gguf import GGUFReader
    from pagedkv.models.gguf_reader import open_gguf

    reader = GGUFReader(tiny)
    with open_gguf(tiny) as ours:
        expected = {n: f.contents() for n, f in reader.fields.items() if not n.startswith("GGUF.")}
        assert ours.metadata.keys() == expected.keys()
        for key, value in expected.items():
            got = ours.metadata[key]
            assert got == value or math.isclose(got, value, rel_tol=1e-6), key
        for tensor in reader.tensors:
            info = ours.tensors[tensor.name]
            assert (info.offset, info.n_bytes, info.type_name) == (
                tensor.data_offset,
                tensor.n_bytes,
                tensor.tensor_type.name,
            )
            assert list(info.dims) == tensor.shape.tolist()


def test_tiny_model_loads_and_dequantizes(tiny):
    model = load_model(tiny)
    assert model.config.num_layers == 1 and model.config.vocab_size == len(TOKENS)
    tensors = default_tensors()
    norm, _ = tensors["blk.0.attn_norm.weight"]
    np.testing.assert_array_equal(model.model.weights.layers[0].attn_norm, norm)  # F32: exact
    embedding, _ = tensors["token_embd.weight"]
    np.testing.assert_allclose(model.model.weights.token_embedding, embedding, atol=0.01)  # Q8_0


# Loader minors: each was a traceback, a silent mis-load or a model with no layers.
MINOR_CASES = {
    "string where a number belongs": (
        {"metadata": {"llama.block_count": ("thirty", "STRING")}},
        "'llama.block_count' is 'thirty'",
    ),
    "float where an integer belongs": (
        {"metadata": {"llama.embedding_length": (32.5, "FLOAT32")}},
        "expected an integer",
    ),
    "block_count -1": ({"metadata": {"llama.block_count": (-1, "INT32")}}, "'llama.block_count' is -1"),
    "block_count 0": ({"metadata": {"llama.block_count": (0, "UINT32")}}, "'llama.block_count' is 0"),
    "block_count 2**40": (
        {"metadata": {"llama.block_count": (1 << 40, "UINT64")}},
        "only 11 tensors",
    ),
    "NaN epsilon": (
        {"metadata": {"llama.attention.layer_norm_rms_epsilon": (math.nan, "FLOAT32")}},
        "layer_norm_rms_epsilon",
    ),
    "merge not in the vocabulary": (
        {"metadata": {"tokenizer.ggml.merges": (["a b", "ab z"], "ARRAY:STRING")}},
        "'z', which is not in the vocabulary",
    ),
    "merge result not in the vocabulary": (
        {"metadata": {"tokenizer.ggml.merges": (["b c"], "ARRAY:STRING")}},
        "'bc', which is not in the vocabulary",
    ),
    "merge without a space": (
        {"metadata": {"tokenizer.ggml.merges": (["ab"], "ARRAY:STRING")}},
        "not two tokens",
    ),
    "duplicate token": (
        {
            "metadata": {
                "tokenizer.ggml.tokens": (["a", "b", "c", "ab", "abc", "a", *TOKENS[6:]], "ARRAY:STRING")
            }
        },
        "repeats token 'a'",
    ),
    "short token_type": (
        {"metadata": {"tokenizer.ggml.token_type": ([1, 1, 1], "ARRAY:INT32")}},
        "3 token types for 9 tokens",
    ),
    "token_type of strings": (
        {"metadata": {"tokenizer.ggml.token_type": (["1"] * 9, "ARRAY:STRING")}},
        "not a list of integers",
    ),
    "tokens not strings": (
        {"metadata": {"tokenizer.ggml.tokens": (list(range(9)), "ARRAY:INT32")}},
        "not a list of strings",
    ),
    "wrong-size attention norm": (
        {"tensors": {"blk.0.attn_norm.weight": (np.ones(31, np.float32), "F32")}},
        "'blk.0.attn_norm.weight' has shape \\(31,\\), expected \\(32,\\)",
    ),
    "wrong-size output norm": (
        {"tensors": {"output_norm.weight": (np.ones(64, np.float32), "F32")}},
        "'output_norm.weight' has shape",
    ),
    "missing tensor": ({"tensors": {"blk.0.ffn_up.weight": OMIT}}, "lacks tensor 'blk.0.ffn_up.weight'"),
    "vocabulary larger than the tokenizer": (
        {
            "metadata": {"llama.vocab_size": (20, "UINT32")},
            "tensors": {"token_embd.weight": (np.zeros((20, 32), np.float32), "Q8_0")},
        },
        "vocab_size is 20 but the tokenizer has 9 tokens",
    ),
    "embedding smaller than the vocabulary": (
        {"tensors": {"token_embd.weight": (np.zeros((5, 32), np.float32), "Q8_0")}},
        "'token_embd.weight' has shape \\(5, 32\\), expected \\(9, 32\\)",
    ),
    "eos id out of range": ({"metadata": {"tokenizer.ggml.eos_token_id": (99, "UINT32")}}, "eos_token_id"),
    "chat template not a string": ({"metadata": {"tokenizer.chat_template": (7, "UINT32")}}, "chat_template"),
    "pre-tokenizer not a string": (
        {"metadata": {"tokenizer.ggml.pre": ([1], "ARRAY:INT32")}},
        "pre-tokenizer",
    ),
}


@pytest.mark.parametrize("case", sorted(MINOR_CASES))
def test_malformed_model_is_a_typed_error_naming_the_problem(case, tmp_path):
    from pagedkv.errors import PagedKvError

    overrides, message = MINOR_CASES[case]
    path = write_tiny_llama(tmp_path / "bad.gguf", **overrides)
    with pytest.raises(PagedKvError, match=message):
        load_model(path)
