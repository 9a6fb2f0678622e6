"""A tiny but complete llama GGUF file written with the ``gguf`` package's ``GGUFWriter``.

One layer, d_model 32 (two heads of 16, one KV head), d_ffn 64, a byte-level BPE vocabulary of
nine tokens with two merges and three control tokens, and tensors in four storage types (Q8_0,
Q4_0, F16, F32), so that every part of the loader (metadata, tokenizer, tensor index, each
dequantizer) is reached. ``pagedkv.models.load_model`` loads it. The loader tests and the fuzz
harness corrupt it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

D_MODEL, N_HEADS, N_KV_HEADS, D_FFN = 32, 2, 1, 64
HEAD_DIM = D_MODEL // N_HEADS
TOKENS = ["a", "b", "c", "ab", "abc", "Ġ", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
TOKEN_TYPES = [1, 1, 1, 1, 1, 1, 3, 3, 3]
MERGES = ["a b", "ab c"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

OMIT = object()  # a metadata value that removes the key


def default_metadata() -> dict[str, tuple[Any, str]]:
    """key -> (value, GGUFValueType name) of the tiny model (general.architecture comes apart)."""
    return {
        "llama.block_count": (1, "UINT32"),
        "llama.context_length": (64, "UINT32"),
        "llama.embedding_length": (D_MODEL, "UINT32"),
        "llama.feed_forward_length": (D_FFN, "UINT32"),
        "llama.attention.head_count": (N_HEADS, "UINT32"),
        "llama.attention.head_count_kv": (N_KV_HEADS, "UINT32"),
        "llama.rope.freq_base": (10000.0, "FLOAT32"),
        "llama.attention.layer_norm_rms_epsilon": (1e-5, "FLOAT32"),
        "llama.vocab_size": (len(TOKENS), "UINT32"),
        "tokenizer.ggml.model": ("gpt2", "STRING"),
        "tokenizer.ggml.pre": ("smollm", "STRING"),
        "tokenizer.ggml.tokens": (list(TOKENS), "ARRAY:STRING"),
        "tokenizer.ggml.token_type": (list(TOKEN_TYPES), "ARRAY:INT32"),
        "tokenizer.ggml.merges": (list(MERGES), "ARRAY:STRING"),
        "tokenizer.ggml.bos_token_id": (6, "UINT32"),
        "tokenizer.ggml.eos_token_id": (7, "UINT32"),
        "tokenizer.chat_template": (CHAT_TEMPLATE, "STRING"),
    }


def default_tensors(vocab: int = len(TOKENS)) -> dict[str, tuple[np.ndarray, str]]:
    """name -> (fp32 row-major values, storage type name)."""
    rng = np.random.default_rng(0)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    q, kv = N_HEADS * HEAD_DIM, N_KV_HEADS * HEAD_DIM
    return {
        "token_embd.weight": (w(vocab, D_MODEL), "Q8_0"),
        "blk.0.attn_norm.weight": (1 + w(D_MODEL), "F32"),
        "blk.0.attn_q.weight": (w(q, D_MODEL), "F16"),
        "blk.0.attn_k.weight": (w(kv, D_MODEL), "F32"),
        "blk.0.attn_v.weight": (w(kv, D_MODEL), "F32"),
        "blk.0.attn_output.weight": (w(D_MODEL, q), "Q8_0"),
        "blk.0.ffn_norm.weight": (1 + w(D_MODEL), "F32"),
        "blk.0.ffn_gate.weight": (w(D_FFN, D_MODEL), "Q4_0"),
        "blk.0.ffn_up.weight": (w(D_FFN, D_MODEL), "Q4_0"),
        "blk.0.ffn_down.weight": (w(D_MODEL, D_FFN), "Q8_0"),
        "output_norm.weight": (1 + w(D_MODEL), "F32"),
    }


def write_tiny_llama(
    path: Path,
    *,
    metadata: dict[str, Any] | None = None,
    tensors: dict[str, Any] | None = None,
    architecture: str = "llama",
) -> Path:
    """Write the tiny model to ``path``. ``metadata`` overrides keys (``(value, type name)``, or
    ``OMIT``); ``tensors`` overrides tensors (``(fp32 values, type name)``, or ``OMIT``)."""
    import gguf

    meta = {**default_metadata(), **(metadata or {})}
    arrays = {**default_tensors(), **(tensors or {})}
    writer = gguf.GGUFWriter(str(path), architecture)
    for key, spec in meta.items():
        if spec is OMIT:
            continue
        value, type_name = spec
        if type_name.startswith("ARRAY:"):
            sub = gguf.GGUFValueType[type_name.split(":", 1)[1]]
            writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=sub)
        else:
            writer.add_key_value(key, value, gguf.GGUFValueType[type_name])
    for name, spec in arrays.items():
        if spec is OMIT:
            continue
        values, type_name = spec
        qtype = gguf.GGMLQuantizationType[type_name]
        if type_name == "F32":
            writer.add_tensor(name, np.ascontiguousarray(values, dtype=np.float32))
        elif type_name == "F16":
            writer.add_tensor(name, np.ascontiguousarray(values, dtype=np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
