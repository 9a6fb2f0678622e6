"""A tiny Gemma 3 with random weights for the hybrid KV groups: 6 layers, every third one global
(layers 2 and 5) and the others sliding-window layers of WINDOW tokens, so that the engine's
layout has one full-attention group and two sliding-window groups of 2 layers each (two K and two
V tensors). d_model 32, vocab 96 (tiny_llama's tokenizer): a forward pass costs about a
millisecond, and the greedy tokens depend on every visible position's K/V (sharp attention:
QK-norm weights of 3), so attending over a wrong or released block changes them."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
from tiny_llama import VOCAB, TinyTokenizer
from tiny_quantized import quantize_layers, quantize_matrix

WINDOW = 8
PATTERN = 3  # layer i is global iff (i + 1) % PATTERN == 0


def tiny_hybrid_model(seed: int = 0, max_model_len: int = 256, window: int = WINDOW):
    from pagedkv.models import Gemma3Config, Gemma3Model, LoadedModel
    from pagedkv.models.gemma3.file import Gemma3File, Gemma3LayerWeights

    c = Gemma3Config(
        num_layers=6,
        d_model=32,
        d_ffn=64,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=8,
        vocab_size=VOCAB,
        max_model_len=max_model_len,
        rope_base_global=1_000_000.0,
        rope_base_local=10_000.0,
        rope_scale_global=1.0,
        sliding_window=window,
        sliding_window_pattern=PATTERN,
        rms_eps=1e-6,
        attention_scale=8**-0.5,
    )
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)

    def norm(n: int, scale: float = 1.0) -> np.ndarray:
        return np.full(n, scale, np.float32)

    layers = [
        Gemma3LayerWeights(
            attn_norm=norm(c.d_model),
            wq=w(c.d_model, c.num_q_heads * c.head_dim),
            wk=w(c.d_model, c.num_kv_heads * c.head_dim),
            wv=w(c.d_model, c.num_kv_heads * c.head_dim),
            q_norm=norm(c.head_dim, 3.0),  # sharp attention: the history matters
            k_norm=norm(c.head_dim, 3.0),
            wo=w(c.num_q_heads * c.head_dim, c.d_model),
            post_attn_norm=norm(c.d_model, 3.0),  # attention outweighs the token's own embedding
            ffn_norm=norm(c.d_model),
            w_gate=w(c.d_model, c.d_ffn),
            w_up=w(c.d_model, c.d_ffn),
            w_down=w(c.d_ffn, c.d_model),
            post_ffn_norm=norm(c.d_model),
        )
        for _ in range(c.num_layers)
    ]
    codes = quantize_layers(layers)
    # RMS 1 after the embedding scale sqrt(d_model); held [d, vocab], the tied output's [in, out].
    embedding = (rng.standard_normal((VOCAB, c.d_model)) / np.sqrt(c.d_model)).astype(np.float32)
    holder = SimpleNamespace(output=embedding.T)
    quantize_matrix(holder, "output", "token_embd.weight", codes)
    weights = Gemma3File(
        path=Path("tiny-random-gemma3.gguf"),
        config=c,
        metadata={},
        token_embedding=np.ascontiguousarray(holder.output.T),
        layers=layers,
        output_norm=norm(c.d_model, 16.0),
        tensor_types={},
        block_codes=codes,
    )
    return LoadedModel(model=Gemma3Model(weights), tokenizer=TinyTokenizer())  # type: ignore[arg-type]
