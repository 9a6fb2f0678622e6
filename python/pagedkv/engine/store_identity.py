"""The salt of the engine's store keys: what must agree for a stored block to be usable.

Blocks go to a ``pagedkv.offload`` store keyed by their chained hash, with the engine's layout
identity (model, layers, heads, head size, block size, dtype) as the salt, so that engines
with another layout or other weights never read each other's entries.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

__all__ = ["layout_identity", "model_fingerprint", "store_identity"]


def model_fingerprint(model: Any) -> str:
    """A digest of the model's constants and a sample of its first layer's weights: two models
    of the same shape but other weights must not share stored K/V."""
    h = hashlib.blake2b(repr(model.config).encode(), digest_size=16)
    layers = getattr(getattr(model.model, "weights", None), "layers", None)
    if layers:
        layer = layers[0]
        for name in sorted(getattr(layer, "__dict__", {})):
            value = getattr(layer, name)
            if isinstance(value, np.ndarray):
                h.update(name.encode())
                h.update(np.ascontiguousarray(value).reshape(-1).view(np.uint8)[: 1 << 16].tobytes())
    return h.hexdigest()


def layout_identity(
    model_name: str, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int
) -> bytes:
    """The salt of the engine's store keys: what must agree for a stored block to be usable."""
    return (
        f"pagedkv-kv-v1|{model_name}|L{num_layers}|H{num_kv_heads}|D{head_dim}|B{block_size}|float32".encode()
    )


def store_identity(model: Any, block_size: int) -> bytes:
    """``layout_identity`` of a loaded model's engine."""
    cfg = model.config
    return layout_identity(
        model_fingerprint(model), cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size
    )
