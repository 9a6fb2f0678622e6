"""Tiny random models on the quantized kernels: each ``[in, out]`` matrix is quantized as Q8_0 does
(``quantize_q8``) and replaced by its dequantized values, and its codes are handed to the model,
so the default ``int8`` weight mode runs them through ``cpu_matmul_dot`` (and ``quantized``
through ``cpu_matmul_blocks``) on the same weights the ``fp32`` mode multiplies (the engine's
"batched equals alone" tests then exercise the kernel the real models use)."""

from __future__ import annotations

from typing import Any

from pagedkv.models.block_codes import BlockCodes, quantize_q8

# (attribute of a layer's weights, GGUF tensor name suffix)
LAYER_MATRICES = (
    ("wq", "attn_q.weight"),
    ("wk", "attn_k.weight"),
    ("wv", "attn_v.weight"),
    ("wo", "attn_output.weight"),
    ("w_gate", "ffn_gate.weight"),
    ("w_up", "ffn_up.weight"),
    ("w_down", "ffn_down.weight"),
)


def quantize_matrix(owner: Any, attr: str, name: str, codes: dict[str, BlockCodes], block: int = 16) -> None:
    """``owner.attr`` (``[in, out]``) replaced by its Q8_0 dequantization; its codes under ``name``."""
    quantized = quantize_q8(getattr(owner, attr).T, block)
    setattr(owner, attr, quantized.dequantize().T)
    codes[name] = quantized


def quantize_layers(layers: list[Any]) -> dict[str, BlockCodes]:
    codes: dict[str, BlockCodes] = {}
    for i, layer in enumerate(layers):
        for attr, suffix in LAYER_MATRICES:
            quantize_matrix(layer, attr, f"blk.{i}.{suffix}", codes)
    return codes
