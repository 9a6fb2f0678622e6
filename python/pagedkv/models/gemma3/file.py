"""Reading a Gemma 3 GGUF file (``general.architecture = gemma3``): its hyperparameters (typed and
range-checked) and every tensor dequantized to fp32 at load, through the same bounded container
reader (``gguf_reader``) and content-keyed weight cache as llama files.

What the file holds, checked against llama.cpp's loader (``llm_build_gemma3``) and Hugging Face's
``modeling_gemma3.py``:

- K-quant tensors (Q4_K, Q6_K in the Q4_K_M file) next to Q5_0 / Q8_0; ``gguf.quants.dequantize``
  decodes all of them (``gguf_file.dequantize``).
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pagedkv.errors import ModelLoadError, UnsupportedModelError
from pagedkv.models.block_codes import BlockCodes
from pagedkv.models.gemma3.config import Gemma3Config
from pagedkv.models.gguf_reader import open_gguf
from pagedkv.models.gguf_tensors import check_index, decoder_shapes, dequantize
from pagedkv.models.metadata import get_float, get_int, get_str
from pagedkv.models.weight_cache import cache_entry_for, load_cached, store_cached

__all__ = [
    "GEMMA3_TENSOR_TYPES",
    "Gemma3File",
    "Gemma3LayerWeights",
    "read_gemma3_config",
    "read_gemma3_gguf",
]

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
    # Block-quantized matrices as 8-bit codes for a model built in memory (see GgufModel).
    block_codes: dict[str, BlockCodes] = field(default_factory=dict)


def gemma3_config(metadata: dict[str, Any], tensor_names: set[str]) -> Gemma3Config:
    """The hyperparameters of a ``gemma3`` GGUF file's metadata (typed and range-checked)."""
    arch = get_str(metadata, "general.architecture")
    if arch != _ARCH:
        raise UnsupportedModelError(f"not a Gemma 3 file: general.architecture is {arch!r}")
    d_model = get_int(metadata, f"{_ARCH}.embedding_length")
    num_q_heads = get_int(metadata, f"{_ARCH}.attention.head_count")
    num_kv_heads = get_int(metadata, f"{_ARCH}.attention.head_count_kv", num_q_heads)
    head_dim = get_int(metadata, f"{_ARCH}.attention.key_length")
    if get_int(metadata, f"{_ARCH}.attention.value_length", head_dim) != head_dim:
        raise UnsupportedModelError("key_length != value_length is not supported")
    if num_q_heads % num_kv_heads or head_dim % 2:
        raise ModelLoadError(
            f"inconsistent attention shape: heads {num_q_heads}/{num_kv_heads}, head_dim {head_dim}"
        )
    num_layers = get_int(metadata, f"{_ARCH}.block_count")
    if num_layers * len(_LAYER_TENSORS) > len(tensor_names):  # a lying count fails here, not per layer
        raise ModelLoadError(
            f"{_ARCH}.block_count is {num_layers} but the file has only {len(tensor_names)} tensors"
        )
    scaling = get_str(metadata, f"{_ARCH}.rope.scaling.type", "none")
    factor = get_float(metadata, f"{_ARCH}.rope.scaling.factor", 1.0)
    if scaling not in ("none", "linear"):
        raise UnsupportedModelError(f"RoPE scaling {scaling!r} (factor {factor}) is not supported")
    tokens = metadata.get("tokenizer.ggml.tokens")
    n_tokens = len(tokens) if isinstance(tokens, list) else None
    vocab = get_int(metadata, f"{_ARCH}.vocab_size", n_tokens if n_tokens is not None else 0)
    if n_tokens is not None and vocab != n_tokens:
        raise ModelLoadError(
            f"{_ARCH}.vocab_size is {vocab} but the tokenizer has {n_tokens} tokens: every id the "
            "model can produce must be a token"
        )
    if vocab < 1:
        raise ModelLoadError(
            "GGUF metadata lacks the vocabulary (tokenizer.ggml.tokens or gemma3.vocab_size)"
        )
    scale_dim = d_model / num_q_heads if num_layers == _LAYERS_27B else head_dim
    return Gemma3Config(
        num_layers=num_layers,
        d_model=d_model,
        d_ffn=get_int(metadata, f"{_ARCH}.feed_forward_length"),
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        max_model_len=get_int(metadata, f"{_ARCH}.context_length"),
        rope_base_global=get_float(metadata, f"{_ARCH}.rope.freq_base", 1_000_000.0),
        rope_base_local=_LOCAL_ROPE_BASE,
        rope_scale_global=1.0 / factor if scaling == "linear" else 1.0,
        sliding_window=get_int(metadata, f"{_ARCH}.attention.sliding_window"),
        sliding_window_pattern=_SLIDING_WINDOW_PATTERN,
        rms_eps=get_float(metadata, f"{_ARCH}.attention.layer_norm_rms_epsilon"),
        attention_scale=float(1.0 / np.sqrt(np.float32(scale_dim))),
    )


# Per-layer tensors (``blk.{i}.{name}.weight``).
_LAYER_TENSORS = (
    "attn_norm",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_q_norm",
    "attn_k_norm",
    "attn_output",
    "post_attention_norm",
    "ffn_norm",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
    "post_ffw_norm",
)


def expected_shapes(c: Gemma3Config) -> dict[str, tuple[int, ...]]:
    """Every tensor the forward pass reads, with its row-major shape (matrices ``[out, in]``):
    the llama set plus the QK-norms and the two post-norms (the output is tied)."""
    extra = {
        "attn_q_norm": (c.head_dim,),
        "attn_k_norm": (c.head_dim,),
        "post_attention_norm": (c.d_model,),
        "post_ffw_norm": (c.d_model,),
    }
    return decoder_shapes(c, extra)


def read_gemma3_config(path: str | os.PathLike[str]) -> Gemma3Config:
    """The hyperparameters of a Gemma 3 GGUF file from its header alone (no tensor is read):
    what a KV-memory estimate needs. The same checks as ``read_gemma3_gguf`` on the metadata."""
    with open_gguf(path) as file:
        return gemma3_config(file.metadata, set(file.tensors))


def read_gemma3_gguf(path: str | os.PathLike[str], *, use_cache: bool = True) -> Gemma3File:
    """Load a Gemma 3 GGUF file: metadata, config and fp32 weights. ModelLoadError for an
    unreadable, truncated, inconsistent or incomplete file; UnsupportedModelError for another
    architecture or a tensor type outside GEMMA3_TENSOR_TYPES. The container is parsed by the
    bounded ``gguf_reader`` and the weights cached by content, as for llama files."""
    with open_gguf(path) as file:
        config = gemma3_config(file.metadata, set(file.tensors))
        shapes = expected_shapes(config)
        if "output.weight" in file.tensors:
            raise UnsupportedModelError(
                "an untied output.weight is not supported for Gemma 3 (the file ties it)"
            )
        check_index(file.tensors, shapes, GEMMA3_TENSOR_TYPES)
        entry = cache_entry_for(file.path) if use_cache else None
        arrays = load_cached(entry, shapes)
        if arrays is None:
            arrays = {name: dequantize(file, file.tensors[name]) for name in shapes}
            store_cached(entry, arrays)
        metadata, tensor_types = file.metadata, {n: t.type_name for n, t in file.tensors.items()}

    def matrix(name: str) -> np.ndarray:
        return arrays[name].T  # [in, out]: a transposed view of the row-major [out, in] array

    layers = []
    for i in range(config.num_layers):
        p = f"blk.{i}."
        layers.append(
            Gemma3LayerWeights(
                attn_norm=arrays[p + "attn_norm.weight"],
                wq=matrix(p + "attn_q.weight"),
                wk=matrix(p + "attn_k.weight"),
                wv=matrix(p + "attn_v.weight"),
                q_norm=arrays[p + "attn_q_norm.weight"],
                k_norm=arrays[p + "attn_k_norm.weight"],
                wo=matrix(p + "attn_output.weight"),
                post_attn_norm=arrays[p + "post_attention_norm.weight"],
                ffn_norm=arrays[p + "ffn_norm.weight"],
                w_gate=matrix(p + "ffn_gate.weight"),
                w_up=matrix(p + "ffn_up.weight"),
                w_down=matrix(p + "ffn_down.weight"),
                post_ffn_norm=arrays[p + "post_ffw_norm.weight"],
            )
        )
    return Gemma3File(
        Path(path),
        config,
        metadata,
        arrays["token_embd.weight"],
        layers,
        arrays["output_norm.weight"],
        tensor_types,
    )
