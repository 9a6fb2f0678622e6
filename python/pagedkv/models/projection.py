"""One projection of a model, ``h [t, in] -> [t, out]``, in the weight mode the model runs.

Modes (``weights=``, else ``PAGEDKV_WEIGHTS``, else ``int8``):

- ``"int8"`` (the default): the GGUF file's block-quantized weights as 8-bit or packed 4-bit codes,
  each row's activations quantized to 8 bits per block and multiplied with integer dot products
  (``dot_weights``): llama.cpp's arithmetic for quantized matrices, 2-3x the fp32 kernel's speed
  at batch 8-32, the same bits on every x86 CPU (AVX-512 VNNI, AVX2 and portable tiles agree),
  a row's result independent of its batch. Falls back to ``fp32`` as ``quantized`` does, and to
  ``quantized`` for a block size the kernel cannot sum exactly (none of the GGUF types).
- ``"quantized"``: the GGUF file's block-quantized weights kept as 8-bit codes (two
  4-bit codes per byte where they fit) with a per-block scale and offset, multiplied by the Rust
  kernel (``block_weights``): the weights are bit-identical to the fp32 dequantization, on both
  cores with the GIL released, and a row's result does not depend on its batch. A matrix the
  file stores unquantized (F32/F16/BF16), or a model built in memory without ``block_codes``,
  falls back to ``fp32``.
- ``"fp32"``: the dequantized fp32 matrix with NumPy's BLAS (the reference the others are
  compared with).
- ``"bf16"``: the weights rounded to bf16 (``bf16_weights``), every batch size through its
  kernel; ``PAGEDKV_BF16_MAX_TOKENS=N`` sends batches of more than N rows to fp32 BLAS instead
  (a row's logits then depend on its batch's size).

docs/cpu_data_plane.md gives the measurements behind the default.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Protocol

import numpy as np

from pagedkv.errors import InvalidArgumentError
from pagedkv.models.bf16_weights import Bf16Weights
from pagedkv.models.block_codes import BlockCodes, tensor_block_codes
from pagedkv.models.block_weights import BlockWeights
from pagedkv.models.dot_weights import DotWeights
from pagedkv.models.gguf_reader import open_gguf

__all__ = [
    "BF16_MAX_TOKENS",
    "WEIGHT_DTYPES",
    "Projection",
    "ProjectionBuilder",
    "default_weight_dtype",
    "file_block_codes",
    "fused",
    "weight_mode",
]

WEIGHT_DTYPES = ("int8", "quantized", "bf16", "fp32")
# Rows up to which a bf16-mode projection uses the bf16 kernel; unset: all.
BF16_MAX_TOKENS = int(os.environ.get("PAGEDKV_BF16_MAX_TOKENS", "0")) or sys.maxsize


def default_weight_dtype() -> str:
    """``PAGEDKV_WEIGHTS`` (int8 | quantized | bf16 | fp32) when set, else int8."""
    return weight_mode(None, "weights")


def weight_mode(choice: str | None, argument: str) -> str:
    """``choice`` when it is one of ``WEIGHT_DTYPES``, else ``PAGEDKV_WEIGHTS`` or int8 when it is
    None; any other value is a ``ValueError`` naming ``argument`` (the models' keyword)."""
    if choice is None:
        choice, argument = os.environ.get("PAGEDKV_WEIGHTS", "") or "int8", "PAGEDKV_WEIGHTS"
    if choice not in WEIGHT_DTYPES:
        raise InvalidArgumentError(f"{argument} must be one of {WEIGHT_DTYPES}, got {choice!r}")
    return choice


class Projection:
    """``h @ W`` for one (possibly fused) weight matrix, through the mode's kernel.

    ``fp32`` builds the fp32 ``[in, out]`` matrix; it is only called when the mode needs it
    (``quantized`` or ``int8`` with every part's ``codes`` present never materialises it)."""

    def __init__(
        self, mode: str, fp32: Callable[[], np.ndarray], codes: Sequence[BlockCodes | None] = ()
    ) -> None:
        self._blocks: BlockWeights | DotWeights | None = None
        self._bf16: Bf16Weights | None = None
        self._fp32: np.ndarray | None = None
        if mode in ("quantized", "int8") and codes and all(c is not None for c in codes):
            stacked = BlockCodes.stack(*[c for c in codes if c is not None])
            # A block the int8 kernel cannot sum exactly (over 256 inputs, or not whole groups;
            # no GGUF type has one) keeps the file's codes in the fp32-arithmetic kernel.
            dot = mode == "int8" and DotWeights.fits(stacked)
            self._blocks = DotWeights(stacked) if dot else BlockWeights(stacked)
            self.out_features = self._blocks.out_features
            return
        self._fp32 = fp32()
        self.out_features = int(self._fp32.shape[1])
        if mode == "bf16":
            self._bf16 = Bf16Weights(self._fp32)

    @property
    def kernel(self) -> str:
        """Which kernel runs: ``"blocks"``, ``"dot"``, ``"bf16"`` or ``"blas"``."""
        if self._blocks is not None:
            return "dot" if isinstance(self._blocks, DotWeights) else "blocks"
        return "bf16" if self._bf16 is not None else "blas"

    def __call__(self, h: np.ndarray) -> np.ndarray:
        if self._blocks is not None:
            return self._blocks.matmul(h)
        if self._bf16 is not None and h.shape[0] <= BF16_MAX_TOKENS:
            return self._bf16.matmul(h)
        assert self._fp32 is not None
        return h @ self._fp32


def fused(*weights: np.ndarray) -> np.ndarray:
    """``[in, out_1 + out_2 + ...]``: the column blocks of several ``[in, out_i]`` projections, as
    the transposed view of one row-major ``[sum out_i, in]`` matrix (the layout the GGUF file's
    matrices already have, so BLAS reads whole rows)."""
    return np.ascontiguousarray(np.concatenate([w.T for w in weights], axis=0), dtype=np.float32).T


def file_block_codes(path: Path) -> dict[str, BlockCodes | None]:
    """The block codes of every matrix of a GGUF file (None for one that is not block-quantized);
    empty when the file is gone."""
    if not path.is_file():
        return {}
    with open_gguf(path) as file:
        return {
            name: tensor_block_codes(file, info)
            for name, info in file.tensors.items()
            if len(info.shape) == 2
        }


class DecoderLayer(Protocol):
    """The ``[in, out]`` matrices of one transformer block (llama's and Gemma 3's layer weights)."""

    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    w_gate: np.ndarray
    w_up: np.ndarray
    w_down: np.ndarray


class ProjectionBuilder:
    """Builds a model's projections in one weight mode: ``builder(names, *fp32_in_out)`` fuses the
    named matrices (their codes from ``block_codes``, else from the file at ``path`` in
    ``quantized`` and ``int8`` modes) or, without codes for all of them, their fp32 ``[in, out]`` matrices."""

    def __init__(self, mode: str, path: Path, block_codes: Mapping[str, BlockCodes]) -> None:
        self.mode = mode
        self._codes: Mapping[str, BlockCodes | None] = {}
        if mode in ("quantized", "int8"):
            self._codes = dict(block_codes) if block_codes else file_block_codes(path)

    def decoder_layers(
        self, layers: Sequence[DecoderLayer]
    ) -> tuple[list[Projection], list[Projection], list[Projection], list[Projection]]:
        """Each layer's fused ``[q | k | v]``, output, fused ``[gate | up]`` and down projections
        (the GGUF tensor names of layer ``i`` are ``blk.{i}.attn_q.weight`` and so on)."""
        qkv, wo, gate_up, down = [], [], [], []
        for i, layer in enumerate(layers):
            blk = f"blk.{i}."
            names = (blk + "attn_q.weight", blk + "attn_k.weight", blk + "attn_v.weight")
            qkv.append(self(names, layer.wq, layer.wk, layer.wv))
            wo.append(self([blk + "attn_output.weight"], layer.wo))
            gate_up.append(self([blk + "ffn_gate.weight", blk + "ffn_up.weight"], layer.w_gate, layer.w_up))
            down.append(self([blk + "ffn_down.weight"], layer.w_down))
        return qkv, wo, gate_up, down

    def __call__(self, names: Sequence[str], *weights: np.ndarray) -> Projection:
        fp32 = partial(fused, *weights) if len(weights) > 1 else partial(np.asarray, weights[0])
        return Projection(self.mode, fp32, [self._codes.get(n) for n in names])
