"""A tiny llama with random weights (2 layers, d_model 32, vocab 96) for scheduler tests that
need many engine steps: every forward pass costs well under a millisecond, and its greedy tokens
depend on every position's K/V, so a sequence attending over the wrong blocks changes its tokens.

The tokenizer decodes each id to one printable character (id 0 is the end-of-generation token),
so stop strings work as with a real model. Its matrices are Q8_0-quantized in memory
(``tiny_quantized``): the default weight mode runs them on the block kernel. ``quantized=False``
keeps the original fp32 weights (on BLAS), for tests whose schedules were searched for against
those weights' tokens."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
from tiny_quantized import quantize_layers, quantize_matrix

VOCAB = 96
EOS = 0


class TinyTokenizer:
    vocab_size = VOCAB
    stop_token_ids = frozenset({EOS})

    def encode(self, text: str) -> list[int]:
        return [ord(ch) - 32 for ch in text]

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        return "".join(chr(32 + i) for i in ids if not (skip_special_tokens and i == EOS))


def tiny_model(seed: int = 0, max_model_len: int = 256, quantized: bool = True):
    from pagedkv.models import LlamaConfig, LlamaModel, LoadedModel
    from pagedkv.models.llama.file import GgufModel, LayerWeights

    c = LlamaConfig(
        num_layers=2,
        d_model=32,
        d_ffn=64,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=8,
        vocab_size=VOCAB,
        max_model_len=max_model_len,
        rope_base=10000.0,
        rms_eps=1e-5,
        tied_embeddings=False,
    )
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)

    layers = [
        LayerWeights(
            attn_norm=np.ones(c.d_model, np.float32),
            wq=w(c.d_model, c.num_q_heads * c.head_dim) * 4,  # sharp attention: history matters
            wk=w(c.d_model, c.num_kv_heads * c.head_dim) * 4,
            wv=w(c.d_model, c.num_kv_heads * c.head_dim),
            wo=w(c.num_q_heads * c.head_dim, c.d_model),
            ffn_norm=np.ones(c.d_model, np.float32),
            w_gate=w(c.d_model, c.d_ffn),
            w_up=w(c.d_model, c.d_ffn),
            w_down=w(c.d_ffn, c.d_model),
        )
        for _ in range(c.num_layers)
    ]
    embedding = rng.standard_normal((VOCAB, c.d_model)).astype(np.float32)  # drawn first, as always
    holder = SimpleNamespace(output=(rng.standard_normal((c.d_model, VOCAB)) * 2).astype(np.float32))
    codes = quantize_layers(layers) if quantized else {}
    if quantized:
        quantize_matrix(holder, "output", "output.weight", codes)
    gguf = GgufModel(
        path=Path("tiny-random-llama.gguf"),
        config=c,
        metadata={},
        token_embedding=embedding,
        layers=layers,
        output_norm=np.ones(c.d_model, np.float32),
        output=holder.output,
        tensor_types={},
        block_codes=codes,
    )
    return LoadedModel(model=LlamaModel(gguf), tokenizer=TinyTokenizer())  # type: ignore[arg-type]
