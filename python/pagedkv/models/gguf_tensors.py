"""The tensor checks and the dequantization every GGUF model loader shares (llama, Gemma 3):
the shapes a llama-family decoder reads, the tensor index checked against them before a byte
of data is read, and one tensor dequantized to fp32 with the ``gguf`` package's kernels."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from pagedkv.errors import ModelLoadError, UnsupportedModelError
from pagedkv.models.gguf_reader import GgufFile, TensorInfo

__all__ = ["SUPPORTED_TENSOR_TYPES", "check_index", "decoder_shapes", "dequantize"]

# Tensor types dequantized at load; anything else is refused by name.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


def decoder_shapes(
    c: Any, extra_per_layer: Mapping[str, tuple[int, ...]] | None = None, *, tied: bool = True
) -> dict[str, tuple[int, ...]]:
    """The tensors every llama-family decoder reads (row-major ``[out, in]``, norms ``[d_model]``),
    plus ``extra_per_layer`` (Gemma's QK-norms and post-norms); ``c`` has the fields both configs
    share (``num_layers``, ``d_model``, ``d_ffn``, heads, ``head_dim``, ``vocab_size``)."""
    q_width, kv_width = c.num_q_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = {
        "attn_norm": (c.d_model,),
        "attn_q": (q_width, c.d_model),
        "attn_k": (kv_width, c.d_model),
        "attn_v": (kv_width, c.d_model),
        "attn_output": (c.d_model, q_width),
        "ffn_norm": (c.d_model,),
        "ffn_gate": (c.d_ffn, c.d_model),
        "ffn_up": (c.d_ffn, c.d_model),
        "ffn_down": (c.d_model, c.d_ffn),
        **(extra_per_layer or {}),
    }
    shapes = {"token_embd.weight": (c.vocab_size, c.d_model), "output_norm.weight": (c.d_model,)}
    if not tied:
        shapes["output.weight"] = (c.vocab_size, c.d_model)
    for i in range(c.num_layers):
        shapes.update({f"blk.{i}.{name}.weight": shape for name, shape in per_layer.items()})
    return shapes


def check_index(
    tensors: dict[str, TensorInfo],
    shapes: dict[str, tuple[int, ...]],
    supported_types: tuple[str, ...] = SUPPORTED_TENSOR_TYPES,
) -> None:
    """Every tensor in ``shapes`` is in the file's index, of a supported type, with that shape
    (checked before a byte of tensor data is read)."""
    for name, shape in shapes.items():
        info = tensors.get(name)
        if info is None:
            raise ModelLoadError(f"GGUF file lacks tensor {name!r}")
        if info.type_name not in supported_types:
            raise UnsupportedModelError(
                f"tensor {name!r} has unsupported type {info.type_name}: supported are "
                f"{', '.join(supported_types)}"
            )
        if info.shape != shape:
            raise ModelLoadError(f"tensor {name!r} has shape {info.shape}, expected {shape}")


def dequantize(file: GgufFile, info: TensorInfo) -> np.ndarray:
    """fp32 row-major ``[..., ne0]`` of one tensor (its size was checked against the file)."""
    from gguf import GGMLQuantizationType, quants

    raw = file.tensor_bytes(info)
    rows = raw.reshape(*info.shape[:-1], info.n_bytes // (int(np.prod(info.shape[:-1])) or 1))
    try:
        values = quants.dequantize(rows, GGMLQuantizationType(info.type_id))
    except Exception as error:  # the kernels' own checks (a row not a whole number of blocks)
        raise ModelLoadError(f"cannot dequantize tensor {info.name!r} ({info.type_name}): {error}") from error
    values = np.ascontiguousarray(values, dtype=np.float32)
    if values.shape != info.shape:
        raise ModelLoadError(f"tensor {info.name!r} dequantized to {values.shape}, expected {info.shape}")
    return values
