"""Reading a llama-architecture GGUF file: the hyperparameters from its metadata (typed and
range-checked), the tensor index checked against the shapes the config implies, and every tensor
dequantized to fp32 with the ``gguf`` package's NumPy kernels. The container itself is parsed by
``gguf_reader`` (bounded: a lying count cannot hang or exhaust memory), the shapes and the
dequantization shared with Gemma 3 are in ``gguf_tensors``.

Tensor layout: GGUF lists a matrix's shape as (ne0, ne1) = (in_features, out_features) and stores
rows of ne0 elements, so a dequantized weight is ``[out_features, in_features]`` and a layer
computes ``x @ W.T``. The loader keeps the transposed view (``[in, out]``; BLAS reads either
order) so that the forward pass is a plain ``x @ W``. Dequantized arrays are cached on disk
(``weight_cache``, keyed by the file's content) so that later loads memory-map them instead of
dequantizing again. Every shape is checked against the index before a byte of data is read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pagedkv.errors import ModelLoadError, UnsupportedModelError
from pagedkv.models.block_codes import BlockCodes
from pagedkv.models.gguf_reader import open_gguf
from pagedkv.models.gguf_tensors import check_index, decoder_shapes, dequantize
from pagedkv.models.llama.config import LlamaConfig
from pagedkv.models.metadata import get_float, get_int, get_str
from pagedkv.models.weight_cache import cache_entry_for, load_cached, store_cached

__all__ = ["GgufModel", "LayerWeights", "expected_shapes", "read_gguf"]

SUPPORTED_ARCHITECTURES = ("llama",)


@dataclass
class LayerWeights:
    """One transformer block, fp32, matrices stored ``[in, out]``."""

    attn_norm: np.ndarray  # [d_model]
    wq: np.ndarray  # [d_model, num_q_heads * head_dim]
    wk: np.ndarray  # [d_model, num_kv_heads * head_dim]
    wv: np.ndarray  # [d_model, num_kv_heads * head_dim]
    wo: np.ndarray  # [num_q_heads * head_dim, d_model]
    ffn_norm: np.ndarray  # [d_model]
    w_gate: np.ndarray  # [d_model, d_ffn]
    w_up: np.ndarray  # [d_model, d_ffn]
    w_down: np.ndarray  # [d_ffn, d_model]


@dataclass
class GgufModel:
    """Everything read from one GGUF file."""

    path: Path
    config: LlamaConfig
    metadata: dict[str, Any]  # scalar and string-list metadata (tokenizer arrays included)
    token_embedding: np.ndarray  # [vocab, d_model]
    layers: list[LayerWeights]
    output_norm: np.ndarray  # [d_model]
    output: np.ndarray  # [d_model, vocab] (the embedding's transpose when tied)
    tensor_types: dict[str, str]  # tensor name -> GGML type name as stored
    # Block-quantized matrices as 8-bit codes (tensor name -> codes), for a model built in memory;
    # empty for a model read from a file (``LlamaModel`` reads the codes from ``path`` itself).
    block_codes: dict[str, BlockCodes] = field(default_factory=dict)


def _config(metadata: dict[str, Any], tensor_names: set[str]) -> LlamaConfig:
    arch = get_str(metadata, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported model architecture {arch!r}: supported are {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    d_model = get_int(metadata, "llama.embedding_length")
    num_q_heads = get_int(metadata, "llama.attention.head_count")
    num_kv_heads = get_int(metadata, "llama.attention.head_count_kv", num_q_heads)
    if d_model % num_q_heads or num_q_heads % num_kv_heads:
        raise ModelLoadError(
            f"inconsistent head counts: d_model {d_model}, heads {num_q_heads}/{num_kv_heads}"
        )
    head_dim = d_model // num_q_heads
    rope_dims = get_int(metadata, "llama.rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise UnsupportedModelError(
            f"partial rotary embedding ({rope_dims} of {head_dim} dims) is not supported"
        )
    tokens = metadata.get("tokenizer.ggml.tokens")
    n_tokens = len(tokens) if isinstance(tokens, list) else None
    vocab = get_int(metadata, "llama.vocab_size", n_tokens if n_tokens is not None else 0)
    if n_tokens is not None and vocab != n_tokens:
        raise ModelLoadError(
            f"llama.vocab_size is {vocab} but the tokenizer has {n_tokens} tokens: every id the "
            "model can produce must be a token"
        )
    if vocab < 1:
        raise ModelLoadError("GGUF metadata lacks the vocabulary (tokenizer.ggml.tokens or llama.vocab_size)")
    num_layers = get_int(metadata, "llama.block_count")
    if num_layers * len(_LAYER_TENSORS) > len(tensor_names):  # a lying count fails here, not per layer
        raise ModelLoadError(
            f"llama.block_count is {num_layers} but the file has only {len(tensor_names)} tensors"
        )
    return LlamaConfig(
        num_layers=num_layers,
        d_model=d_model,
        d_ffn=get_int(metadata, "llama.feed_forward_length"),
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        max_model_len=get_int(metadata, "llama.context_length"),
        rope_base=get_float(metadata, "llama.rope.freq_base", 10000.0),
        rms_eps=get_float(metadata, "llama.attention.layer_norm_rms_epsilon"),
        tied_embeddings="output.weight" not in tensor_names,
    )


# Per-layer tensors and their row-major shape [out, in] (norms [d_model]) in terms of the config.
_LAYER_TENSORS = (
    "attn_norm",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_norm",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
)


def expected_shapes(c: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the forward pass reads, with the row-major shape it must have."""
    return decoder_shapes(c, tied=c.tied_embeddings)


def read_gguf(path: str | os.PathLike[str], *, use_cache: bool = True) -> GgufModel:
    """Load a llama GGUF file: metadata, config and fp32 weights. Raises ModelLoadError for an
    unreadable, truncated, inconsistent or incomplete file and UnsupportedModelError for an
    architecture or tensor type outside SUPPORTED_ARCHITECTURES / SUPPORTED_TENSOR_TYPES."""
    with open_gguf(path) as file:
        config = _config(file.metadata, set(file.tensors))
        shapes = expected_shapes(config)
        check_index(file.tensors, shapes)
        entry = cache_entry_for(file.path) if use_cache else None
        arrays = load_cached(entry, shapes)
        if arrays is None:
            arrays = {name: dequantize(file, file.tensors[name]) for name in shapes}
            store_cached(entry, arrays)
        metadata, tensor_types = file.metadata, {n: t.type_name for n, t in file.tensors.items()}

    def matrix(name: str) -> np.ndarray:
        return arrays[name].T  # [in, out]: a transposed view of the row-major [out, in] array

    layers = [
        LayerWeights(
            attn_norm=arrays[f"blk.{i}.attn_norm.weight"],
            wq=matrix(f"blk.{i}.attn_q.weight"),
            wk=matrix(f"blk.{i}.attn_k.weight"),
            wv=matrix(f"blk.{i}.attn_v.weight"),
            wo=matrix(f"blk.{i}.attn_output.weight"),
            ffn_norm=arrays[f"blk.{i}.ffn_norm.weight"],
            w_gate=matrix(f"blk.{i}.ffn_gate.weight"),
            w_up=matrix(f"blk.{i}.ffn_up.weight"),
            w_down=matrix(f"blk.{i}.ffn_down.weight"),
        )
        for i in range(config.num_layers)
    ]
    embedding = arrays["token_embd.weight"]
    return GgufModel(
        path=Path(path),
        config=config,
        metadata=metadata,
        token_embedding=embedding,
        layers=layers,
        output_norm=arrays["output_norm.weight"],
        output=embedding.T if config.tied_embeddings else matrix("output.weight"),
        tensor_types=tensor_types,
    )
