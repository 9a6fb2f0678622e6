"""A projection's weights kept as the GGUF file's block-quantized codes, and their product with
fp32 activations (the Rust kernel ``_core.cpu_matmul_blocks``).

Every block type the models load is ``scale * code + offset`` per block of 16 or 32 inputs, with
``scale * code`` exact in fp32 (``block_codes``), so the kernel's ``fma(scale, code, offset)``
rebuilds the fp32 dequantized weight **bit for bit** while reading one byte per weight instead of
four, or half a byte when every code of the matrix fits 4 bits (Q4_0, Q4_1, Q4_K: two codes per
byte, ``CODE_FORMATS``). The kernel sums each output in input order with fused multiply-adds,
tile by tile, on both cores with the GIL released; a row's result does not depend on its
batch (docs/cpu_data_plane.md has the design and the measurements).

``BlockWeights.from_codes(*parts)`` fuses several ``[out_i, in]`` matrices (the QKV or gate/up
groups) into one ``[in, sum out_i]`` product; matrices with different block sizes are re-expressed
in the smallest (scales repeated), which changes no weight.
"""

from __future__ import annotations

import numpy as np

from pagedkv import _core
from pagedkv.models.block_codes import BlockCodes

__all__ = ["CODE_FORMATS", "PANEL_COLS", "BlockWeights", "code_format", "panel_scales"]

PANEL_COLS = 16  # output columns per panel (the kernel's register tile)
# How a panel row holds its 16 codes: name -> (bytes per row, smallest code, largest code).
CODE_FORMATS = {"u4": (8, 0, 15), "i4": (8, -8, 7), "i8": (16, -128, 127)}


def code_format(codes: np.ndarray) -> str:
    """The narrowest format holding every code: ``"u4"`` (0..15), ``"i4"`` (-8..7), else ``"i8"``."""
    if codes.size == 0:
        return "i8"
    lo, hi = int(codes.min()), int(codes.max())
    for name, (_, low, high) in CODE_FORMATS.items():
        if low <= lo and hi <= high:
            return name
    return "i8"


def panel_scales(codes: BlockCodes) -> tuple[np.ndarray, np.ndarray]:
    """The scales and offsets as float32 ``[panels, k / block, 16]`` (columns past ``n`` zero): the
    layout both kernels read."""
    n, k = codes.codes.shape
    panels, nb = -(-n // PANEL_COLS), k // codes.block
    pad = ((0, panels * PANEL_COLS - n), (0, 0))
    return tuple(  # type: ignore[return-value]
        np.ascontiguousarray(np.pad(a, pad).reshape(panels, PANEL_COLS, nb).transpose(0, 2, 1), np.float32)
        for a in (codes.scales, codes.offsets)
    )


class BlockWeights:
    """An ``[in, out]`` projection as the kernel's panels of codes, scales and offsets."""

    def __init__(self, codes: BlockCodes) -> None:
        n, k = codes.codes.shape
        panels = -(-n // PANEL_COLS)
        c = np.pad(codes.codes, ((0, panels * PANEL_COLS - n), (0, 0)))
        self.in_features, self.out_features, self.block = int(k), int(n), int(codes.block)
        self.code_format = code_format(codes.codes)
        # [panels, k, 16] and [panels, k / block, 16]: a panel's codes stream in input order.
        rows = c.reshape(panels, PANEL_COLS, k).transpose(0, 2, 1)
        if self.code_format == "i8":
            self.codes = np.ascontiguousarray(rows).view(np.uint8)
        else:  # byte j of a row: column j in the low nibble, column j + 8 in the high one
            nibbles = rows.view(np.uint8) & np.uint8(15)
            half = PANEL_COLS // 2
            self.codes = np.ascontiguousarray(nibbles[..., :half] | (nibbles[..., half:] << np.uint8(4)))
        self.scales, self.offsets = panel_scales(codes)

    @classmethod
    def from_codes(cls, *parts: BlockCodes) -> BlockWeights:
        """One projection of the parts' output features side by side (in order)."""
        return cls(BlockCodes.stack(*parts))

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """``x [t, in]`` (float32) @ the weights: fp32 ``[t, out]``. A wrong dtype, rank or width
        raises ``InvalidArgumentError``."""
        if isinstance(x, np.ndarray) and not x.flags.c_contiguous:
            x = np.ascontiguousarray(x)
        return _core.cpu_matmul_blocks(
            x, self.codes, self.scales, self.offsets, self.out_features, self.block, self.code_format
        )

    def to_f32(self) -> np.ndarray:
        """The weights as fp32 ``[in, out]``, computed as the kernel does (bit-equal to the file's
        fp32 dequantization)."""
        k = self.in_features
        scales = np.repeat(self.scales, self.block, axis=1)  # [panels, k, 16]
        offsets = np.repeat(self.offsets, self.block, axis=1)
        w = scales * self.panel_codes().astype(np.float32) + offsets
        return np.ascontiguousarray(
            w.transpose(1, 0, 2).reshape(k, w.shape[0] * PANEL_COLS)[:, : self.out_features]
        )

    def panel_codes(self) -> np.ndarray:
        """The codes as int8 ``[panels, k, 16]`` (unpacked from 4 bits where packed)."""
        if self.code_format == "i8":
            return self.codes.view(np.int8)
        low, high = self.codes & np.uint8(15), self.codes >> np.uint8(4)
        codes = np.concatenate([low, high], axis=-1).astype(np.int8)
        return codes - np.int8(16) * (codes > 7) if self.code_format == "i4" else codes
