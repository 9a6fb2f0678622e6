"""Reading a llama-architecture GGUF file with the ``gguf`` package: the hyperparameters from its
metadata and every tensor dequantized to fp32 at load.

Tensor layout: GGUF lists a matrix's shape as (ne0, ne1) = (in_features, out_features) and stores
rows of ne0 elements, so a dequantized weight is ``[out_features, in_features]`` and a layer
computes ``x @ W.T``. The loader keeps the transposed view (``[in, out]``; BLAS reads either
order) so that the forward pass is a plain ``x @ W``. Dequantized arrays are cached on disk
(``weight_cache``) so that later loads memory-map them instead of dequantizing again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pagedkv.models.config import LlamaConfig
from pagedkv.models.errors import ModelLoadError, UnsupportedModelError
from pagedkv.models.weight_cache import cache_dir_for, load_cached, store_cached

__all__ = ["SUPPORTED_TENSOR_TYPES", "GgufModel", "LayerWeights", "read_gguf"]

# Tensor types dequantized at load; anything else is refused by name.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
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


def _field_value(field: Any) -> Any:
    try:
        return field.contents()
    except Exception as error:  # a malformed field: report which
        raise ModelLoadError(f"cannot decode GGUF metadata field {field.name!r}: {error}") from error


def _open(path: Path) -> Any:
    from gguf import GGUFReader

    if not path.is_file():
        raise ModelLoadError(f"model file not found: {str(path)!r}")
    try:
        return GGUFReader(path)
    except Exception as error:  # the reader raises ValueError/IndexError/... on bad bytes
        raise ModelLoadError(
            f"{str(path)!r} is not a readable GGUF file ({type(error).__name__}: {error})"
        ) from error


def _require(metadata: dict[str, Any], key: str) -> Any:
    if key not in metadata:
        raise ModelLoadError(f"GGUF metadata lacks {key!r}")
    return metadata[key]


def _config(metadata: dict[str, Any], tensor_names: set[str]) -> LlamaConfig:
    arch = _require(metadata, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported model architecture {arch!r}: supported are {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    d_model = int(_require(metadata, "llama.embedding_length"))
    num_q_heads = int(_require(metadata, "llama.attention.head_count"))
    num_kv_heads = int(metadata.get("llama.attention.head_count_kv", num_q_heads))
    if num_q_heads <= 0 or num_kv_heads <= 0 or d_model % num_q_heads or num_q_heads % num_kv_heads:
        raise ModelLoadError(
            f"inconsistent head counts: d_model {d_model}, heads {num_q_heads}/{num_kv_heads}"
        )
    head_dim = d_model // num_q_heads
    rope_dims = int(metadata.get("llama.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise UnsupportedModelError(
            f"partial rotary embedding ({rope_dims} of {head_dim} dims) is not supported"
        )
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab = int(metadata.get("llama.vocab_size", len(tokens) if tokens is not None else 0))
    return LlamaConfig(
        num_layers=int(_require(metadata, "llama.block_count")),
        d_model=d_model,
        d_ffn=int(_require(metadata, "llama.feed_forward_length")),
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        max_model_len=int(_require(metadata, "llama.context_length")),
        rope_base=float(metadata.get("llama.rope.freq_base", 10000.0)),
        rms_eps=float(_require(metadata, "llama.attention.layer_norm_rms_epsilon")),
        tied_embeddings="output.weight" not in tensor_names,
    )


def _dequantize(tensor: Any) -> np.ndarray:
    """fp32 ``[ne1, ne0]`` (rows of ne0) of one GGUF tensor."""
    from gguf import quants

    type_name = tensor.tensor_type.name
    if type_name not in SUPPORTED_TENSOR_TYPES:
        raise UnsupportedModelError(
            f"tensor {tensor.name!r} has unsupported type {type_name}: supported are "
            f"{', '.join(SUPPORTED_TENSOR_TYPES)}"
        )
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))  # [ne1, ne0] (row-major)
    expected = int(np.prod(shape))
    try:
        values = quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
    except Exception as error:
        raise ModelLoadError(f"cannot dequantize tensor {tensor.name!r} ({type_name}): {error}") from error
    values = np.asarray(values, dtype=np.float32)
    if values.size != expected:  # a truncated data section
        raise ModelLoadError(
            f"tensor {tensor.name!r} has {values.size} values, its shape {shape} needs {expected}"
        )
    return values.reshape(shape)


def read_gguf(path: str | os.PathLike[str], *, use_cache: bool = True) -> GgufModel:
    """Load a llama GGUF file: metadata, config and fp32 weights. Raises ModelLoadError for an
    unreadable, truncated or incomplete file and UnsupportedModelError for an architecture or
    tensor type outside SUPPORTED_ARCHITECTURES / SUPPORTED_TENSOR_TYPES."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"model file not found: {str(path)!r}")
    cache = cache_dir_for(path) if use_cache else None
    cached = load_cached(cache)
    fresh: dict[str, np.ndarray] = {}
    if cached is not None:  # parsing the GGUF metadata alone takes a minute on a busy CPU
        metadata, tensor_types, arrays = cached
    else:
        reader = _open(path)
        metadata = {name: _field_value(field) for name, field in reader.fields.items()}
        tensors = {t.name: t for t in reader.tensors}
        tensor_types = {name: t.tensor_type.name for name, t in tensors.items()}
        end = os.path.getsize(path)
        for tensor in tensors.values():  # the reader memory-maps lazily; check sizes up front
            if int(tensor.data_offset) + int(tensor.n_bytes) > end:
                raise ModelLoadError(
                    f"{str(path)!r} is truncated: tensor {tensor.name!r} runs past the end of the file"
                )
    config = _config(metadata, set(tensor_types))
    for name, type_name in tensor_types.items():
        if type_name not in SUPPORTED_TENSOR_TYPES:
            raise UnsupportedModelError(
                f"tensor {name!r} has unsupported type {type_name}: supported are "
                f"{', '.join(SUPPORTED_TENSOR_TYPES)}"
            )

    def weight(name: str) -> np.ndarray:
        if name not in tensor_types:
            raise ModelLoadError(f"GGUF file lacks tensor {name!r}")
        if cached is not None:
            if name not in arrays:
                raise ModelLoadError(f"the weight cache {str(cache)!r} lacks {name!r}: delete it")
            return arrays[name]
        fresh[name] = _dequantize(tensors[name])
        return fresh[name]

    def matrix(name: str, rows_in: int, cols_out: int) -> np.ndarray:
        w = weight(name)
        if w.shape != (cols_out, rows_in):
            raise ModelLoadError(f"tensor {name!r} has shape {w.shape}, expected {(cols_out, rows_in)}")
        return w.T  # [in, out]: a transposed view of the row-major [out, in] array

    c = config
    q_width, kv_width = c.num_q_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layers = [
        LayerWeights(
            attn_norm=weight(f"blk.{i}.attn_norm.weight").reshape(c.d_model),
            wq=matrix(f"blk.{i}.attn_q.weight", c.d_model, q_width),
            wk=matrix(f"blk.{i}.attn_k.weight", c.d_model, kv_width),
            wv=matrix(f"blk.{i}.attn_v.weight", c.d_model, kv_width),
            wo=matrix(f"blk.{i}.attn_output.weight", q_width, c.d_model),
            ffn_norm=weight(f"blk.{i}.ffn_norm.weight").reshape(c.d_model),
            w_gate=matrix(f"blk.{i}.ffn_gate.weight", c.d_model, c.d_ffn),
            w_up=matrix(f"blk.{i}.ffn_up.weight", c.d_model, c.d_ffn),
            w_down=matrix(f"blk.{i}.ffn_down.weight", c.d_ffn, c.d_model),
        )
        for i in range(c.num_layers)
    ]
    embedding = weight("token_embd.weight")
    if embedding.shape != (c.vocab_size, c.d_model):
        raise ModelLoadError(
            f"token_embd.weight has shape {embedding.shape}, expected {(c.vocab_size, c.d_model)}"
        )
    output = embedding.T if c.tied_embeddings else matrix("output.weight", c.d_model, c.vocab_size)
    output_norm = weight("output_norm.weight").reshape(c.d_model)
    if fresh:
        store_cached(cache, metadata, tensor_types, fresh)
    return GgufModel(
        path=path,
        config=config,
        metadata=metadata,
        token_embedding=embedding,
        layers=layers,
        output_norm=output_norm,
        output=output,
        tensor_types=tensor_types,
    )
