"""The GGUF loader, tokenizer and forward pass of SmolLM2-135M-Instruct."""

from __future__ import annotations

import numpy as np
import pytest
from pagedkv.models.llama import rotary_interleaved


def test_hyperparameters_from_metadata(smollm):
    c = smollm.config
    assert (c.num_layers, c.d_model, c.num_q_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert c.rope_base == 100000.0 and c.tied_embeddings and c.vocab_size == 49152


def test_tokenizer_splits_digits_parses_control_tokens_no_bos(smollm):
    tok = smollm.tokenizer
    ids = tok.encode("12345")
    assert len(ids) == 5 and tok.decode(ids) == "12345"  # SmolLM's pre-tokenizer: one digit each
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and 1 not in ids[1:]  # control tokens parsed, no BOS added
    text = "Ünïcödé — 日本語, naïve café! ¿Qué?"
    assert tok.decode(tok.encode(text)) == text


def test_chat_template_renders_system_prompt(smollm):
    text = smollm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")


def test_chat_template_renders_as_plain_jinja(smollm):
    """The bounded renderer changes no byte of SmolLM2's real template."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    tok = smollm.tokenizer
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi ünïcode"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "2 + 2?"},
    ]
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(tok.chat_template)
    for add in (True, False):
        expected = plain.render(
            messages=messages, add_generation_prompt=add, bos_token="<|im_start|>", eos_token="<|im_end|>"
        )
        assert tok.apply_chat_template(messages, add_generation_prompt=add) == expected


def test_metadata_is_read_exactly(smollm):
    meta = smollm.model.weights.metadata
    assert len(meta["tokenizer.ggml.tokens"]) == len(meta["tokenizer.ggml.token_type"]) == 49152
    assert len(meta["tokenizer.ggml.merges"]) == 48900 and meta["tokenizer.ggml.pre"] == "smollm"
    assert smollm.model.weights.tensor_types["token_embd.weight"] == "Q8_0"


def test_rotary_rotates_adjacent_pairs():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 2, 8)).astype(np.float32)
    angles = rng.standard_normal((3, 4)).astype(np.float32)
    out = rotary_interleaved(x, np.cos(angles), np.sin(angles))
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * angles)[:, None, :]
    np.testing.assert_allclose(out[..., 0::2], z.real, atol=1e-6)
    np.testing.assert_allclose(out[..., 1::2], z.imag, atol=1e-6)


def test_bad_path_and_truncated_file_are_typed_errors(tmp_path, smollm):
    from pagedkv.models import ModelLoadError, load_model

    with pytest.raises(ModelLoadError, match="not found"):
        load_model(tmp_path / "missing.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(smollm.model.weights.path.read_bytes()[: 4 << 20])
    with pytest.raises(ModelLoadError):
        load_model(cut)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError):
        load_model(junk)


def test_unsupported_architecture_is_named(tmp_path):
    gguf = pytest.importorskip("gguf")
    from pagedkv.models import UnsupportedModelError, load_model

    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="'gpt2'"):
        load_model(path)
