"""Reading a Gemma 3 GGUF file (``general.architecture = gemma3``) with the ``gguf`` package:
its hyperparameters and every tensor dequantized to fp32 at load.

What the file holds, checked against llama.cpp's loader (``llm_build_gemma3``) and Hugging Face's
``modeling_gemma3.py``:

- K-quant tensors (Q4_K, Q6_K in the Q4_K_M file) next to Q5_0 / Q8_0; ``gguf.quants.dequantize``
  decodes all of them.
- The RMSNorm weights are stored as ``1 + w``: llama.cpp's converter adds the 1 that Gemma's
  ``x * (1 + w)`` norm applies, so they multiply as stored (the file's norm weights are centred
  near 1, not 0).
- The output projection is tied to ``token_embd`` (no ``output.weight``).
- ``head_dim`` is ``attention.key_length`` (256), not ``embedding_length / head_count``.
- What the metadata does not say is llama.cpp's: one global layer in six (pattern 6), RoPE base
  10,000 on the sliding-window layers, attention scale ``head_dim ** -0.5`` (``(d_model /
  heads) ** -0.5`` for the 62-layer 27B, whose query_pre_attn_scalar differs).

Matrices are kept ``[in, out]`` (the transposed view of GGUF's row-major ``[out, in]``), so the
forward pass is ``x @ W``. Dequantized arrays are cached on disk (``weight_cache``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pagedkv.models.errors import ModelLoadError, UnsupportedModelError
from pagedkv.models.gemma3_config import Gemma3Config
from pagedkv.models.weight_cache import cache_dir_for, load_cached, store_cached

__all__ = ["GEMMA3_TENSOR_TYPES", "Gemma3File", "Gemma3LayerWeights", "read_gemma3_gguf"]

GEMMA3_TENSOR_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)
_ARCH = "gemma3"
_LOCAL_ROPE_BASE = 10_000.0
_SLIDING_WINDOW_PATTERN = 6
_LAYERS_27B = 62


@dataclass
class Gemma3LayerWeights:
    """One transformer block, fp32, matrices stored ``[in, out]``."""

    attn_norm: np.ndarray  # [d_model]
    wq: np.ndarray  # [d_model, num_q_heads * head_dim]
    wk: np.ndarray  # [d_model, num_kv_heads * head_dim]
    wv: np.ndarray  # [d_model, num_kv_heads * head_dim]
    q_norm: np.ndarray  # [head_dim] (QK-norm, per head)
    k_norm: np.ndarray  # [head_dim]
    wo: np.ndarray  # [num_q_heads * head_dim, d_model]
    post_attn_norm: np.ndarray  # [d_model]
    ffn_norm: np.ndarray  # [d_model]
    w_gate: np.ndarray  # [d_model, d_ffn]
    w_up: np.ndarray  # [d_model, d_ffn]
    w_down: np.ndarray  # [d_ffn, d_model]
    post_ffn_norm: np.ndarray  # [d_model]


@dataclass
class Gemma3File:
    """Everything read from one Gemma 3 GGUF file."""

    path: Path
    config: Gemma3Config
    metadata: dict[str, Any]
    token_embedding: np.ndarray  # [vocab, d_model] (also the tied output projection)
    layers: list[Gemma3LayerWeights]
    output_norm: np.ndarray  # [d_model]
    tensor_types: dict[str, str]


def _require(metadata: dict[str, Any], key: str) -> Any:
    if key not in metadata:
        raise ModelLoadError(f"GGUF metadata lacks {key!r}")
    return metadata[key]


def gemma3_config(metadata: dict[str, Any]) -> Gemma3Config:
    """The hyperparameters of a ``gemma3`` GGUF file's metadata."""
    arch = metadata.get("general.architecture")
    if arch != _ARCH:
        raise UnsupportedModelError(f"not a Gemma 3 file: general.architecture is {arch!r}")

    def key(name: str) -> Any:
        return _require(metadata, f"{_ARCH}.{name}")

    d_model = int(key("embedding_length"))
    num_q_heads = int(key("attention.head_count"))
    num_kv_heads = int(metadata.get(f"{_ARCH}.attention.head_count_kv", num_q_heads))
    head_dim = int(key("attention.key_length"))
    if int(metadata.get(f"{_ARCH}.attention.value_length", head_dim)) != head_dim:
        raise UnsupportedModelError("key_length != value_length is not supported")
    if min(num_q_heads, num_kv_heads, head_dim, d_model) <= 0 or num_q_heads % num_kv_heads or head_dim % 2:
        raise ModelLoadError(
            f"inconsistent attention shape: heads {num_q_heads}/{num_kv_heads}, head_dim {head_dim}"
        )
    num_layers = int(key("block_count"))
    scaling = metadata.get(f"{_ARCH}.rope.scaling.type", "none")
    factor = float(metadata.get(f"{_ARCH}.rope.scaling.factor", 1.0) or 1.0)
    if scaling not in ("none", "linear") or factor <= 0:
        raise UnsupportedModelError(f"RoPE scaling {scaling!r} (factor {factor}) is not supported")
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab = int(metadata.get(f"{_ARCH}.vocab_size", len(tokens) if tokens is not None else 0))
    scale_dim = d_model / num_q_heads if num_layers == _LAYERS_27B else head_dim
    return Gemma3Config(
        num_layers=num_layers,
        d_model=d_model,
        d_ffn=int(key("feed_forward_length")),
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        max_model_len=int(key("context_length")),
        rope_base_global=float(metadata.get(f"{_ARCH}.rope.freq_base", 1_000_000.0)),
        rope_base_local=_LOCAL_ROPE_BASE,
        rope_scale_global=1.0 / factor if scaling == "linear" else 1.0,
        sliding_window=int(key("attention.sliding_window")),
        sliding_window_pattern=_SLIDING_WINDOW_PATTERN,
        rms_eps=float(key("attention.layer_norm_rms_epsilon")),
        attention_scale=float(1.0 / np.sqrt(np.float32(scale_dim))),
    )


def _dequantize(tensor: Any) -> np.ndarray:
    """fp32 ``[ne1, ne0]`` (rows of ne0) of one GGUF tensor."""
    from gguf import quants

    type_name = tensor.tensor_type.name
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    try:
        values = np.asarray(quants.dequantize(np.asarray(tensor.data), tensor.tensor_type), dtype=np.float32)
    except Exception as error:  # the dequantizers raise ValueError/IndexError/... on bad bytes
        raise ModelLoadError(f"cannot dequantize tensor {tensor.name!r} ({type_name}): {error}") from error
    if values.size != int(np.prod(shape)):
        raise ModelLoadError(f"tensor {tensor.name!r} has {values.size} values, its shape {shape} needs more")
    return values.reshape(shape)


def _read_fresh(path: Path) -> tuple[dict[str, Any], dict[str, str], Any]:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as error:
        raise ModelLoadError(
            f"{str(path)!r} is not a readable GGUF file ({type(error).__name__}: {error})"
        ) from error
    metadata = {}
    for name, field in reader.fields.items():
        try:
            metadata[name] = field.contents()
        except Exception as error:
            raise ModelLoadError(f"cannot decode GGUF metadata field {name!r}: {error}") from error
    tensors = {t.name: t for t in reader.tensors}
    end = os.path.getsize(path)
    for tensor in tensors.values():
        if int(tensor.data_offset) + int(tensor.n_bytes) > end:
            raise ModelLoadError(f"{str(path)!r} is truncated: tensor {tensor.name!r} runs past the end")
    return metadata, {n: t.tensor_type.name for n, t in tensors.items()}, tensors


def read_gemma3_gguf(path: str | os.PathLike[str], *, use_cache: bool = True) -> Gemma3File:
    """Load a Gemma 3 GGUF file: metadata, config and fp32 weights. ModelLoadError for an
    unreadable, truncated or incomplete file; UnsupportedModelError for another architecture or
    a tensor type outside GEMMA3_TENSOR_TYPES."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"model file not found: {str(path)!r}")
    cache = cache_dir_for(path) if use_cache else None
    cached = load_cached(cache)
    tensors: Any = None
    if cached is not None:
        metadata, tensor_types, arrays = cached
    else:
        metadata, tensor_types, tensors = _read_fresh(path)
    config = gemma3_config(metadata)
    for name, type_name in tensor_types.items():
        if type_name not in GEMMA3_TENSOR_TYPES:
            raise UnsupportedModelError(
                f"tensor {name!r} has unsupported type {type_name}: supported are "
                f"{', '.join(GEMMA3_TENSOR_TYPES)}"
            )
    fresh: dict[str, np.ndarray] = {}

    def weight(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in tensor_types:
            raise ModelLoadError(f"GGUF file lacks tensor {name!r}")
        if cached is not None:
            if name not in arrays:
                raise ModelLoadError(f"the weight cache {str(cache)!r} lacks {name!r}: delete it")
            w = arrays[name]
        else:
            w = fresh[name] = _dequantize(tensors[name])
        if w.size != int(np.prod(shape)):
            raise ModelLoadError(f"tensor {name!r} has shape {w.shape}, expected {shape}")
        return w.reshape(shape)

    def matrix(name: str, rows_in: int, cols_out: int) -> np.ndarray:
        w = weight(name, (cols_out, rows_in))
        return w.T  # [in, out]: a transposed view of the row-major [out, in] array

    c = config
    q_width, kv_width = c.num_q_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layers = []
    for i in range(c.num_layers):
        p = f"blk.{i}."
        layers.append(
            Gemma3LayerWeights(
                attn_norm=weight(p + "attn_norm.weight", (c.d_model,)),
                wq=matrix(p + "attn_q.weight", c.d_model, q_width),
                wk=matrix(p + "attn_k.weight", c.d_model, kv_width),
                wv=matrix(p + "attn_v.weight", c.d_model, kv_width),
                q_norm=weight(p + "attn_q_norm.weight", (c.head_dim,)),
                k_norm=weight(p + "attn_k_norm.weight", (c.head_dim,)),
                wo=matrix(p + "attn_output.weight", q_width, c.d_model),
                post_attn_norm=weight(p + "post_attention_norm.weight", (c.d_model,)),
                ffn_norm=weight(p + "ffn_norm.weight", (c.d_model,)),
                w_gate=matrix(p + "ffn_gate.weight", c.d_model, c.d_ffn),
                w_up=matrix(p + "ffn_up.weight", c.d_model, c.d_ffn),
                w_down=matrix(p + "ffn_down.weight", c.d_ffn, c.d_model),
                post_ffn_norm=weight(p + "post_ffw_norm.weight", (c.d_model,)),
            )
        )
    if "output.weight" in tensor_types:
        raise UnsupportedModelError("an untied output.weight is not supported for Gemma 3 (the file ties it)")
    embedding = weight("token_embd.weight", (c.vocab_size, c.d_model))
    output_norm = weight("output_norm.weight", (c.d_model,))
    if fresh:
        store_cached(cache, metadata, tensor_types, fresh)
    return Gemma3File(path, config, metadata, embedding, layers, output_norm, tensor_types)
