"""A projection's weights as the file's block codes laid out for integer dot products with 8-bit
activations (the ``int8`` weight mode; the Rust kernel ``_core.cpu_matmul_dot``).

Each row of activations is quantized per block of the weights' inputs (16 or 32) to codes in
-127..127 with one fp32 step (``max|x| / 127``, as llama.cpp's Q8_0), each block's products are
summed exactly in integers and scaled once: ``step * scale * sum(a * code) + offset * sum(x)``.
That is llama.cpp's own arithmetic for quantized matrices; against the fp32 product it adds the
activations' rounding (at most half a step per input), and in exchange the kernel does four
times the multiply-adds per instruction (AVX-512 VNNI; a portable path elsewhere gives the same
bits). A row's result does not depend on its batch. docs/cpu_data_plane.md has the measurements.

Layout: panels of 16 output columns; 64 bytes per group of inputs, byte ``4 * c + j`` for column
``c``: for ``"i8"`` codes, input ``4 * g + j`` of group ``g`` (the code plus 128); for the 4-bit
formats, input ``8 * h + j`` in the low nibble and ``8 * h + 4 + j`` in the high one (``"i4"``
codes plus 8). Scales and offsets as ``block_weights.panel_scales``.
"""

from __future__ import annotations

import numpy as np

from pagedkv import _core
from pagedkv.errors import InvalidArgumentError
from pagedkv.models.block_codes import BlockCodes
from pagedkv.models.block_weights import PANEL_COLS, code_format, panel_scales

__all__ = ["GROUP_INPUTS", "MAX_BLOCK", "DotWeights"]

# Inputs per 64-byte group of a panel, and what makes a code unsigned, per code format.
GROUP_INPUTS = {"i8": 4, "u4": 8, "i4": 8}
_BIAS = {"i8": 128, "u4": 0, "i4": 8}
MAX_BLOCK = 256  # a block's integer sum stays exact in fp32 (the kernel's bound)


class DotWeights:
    """An ``[in, out]`` projection in the dot layout (module docs)."""

    @staticmethod
    def fits(codes: BlockCodes) -> bool:
        """Whether the kernel takes these codes: blocks of whole groups, at most ``MAX_BLOCK``."""
        return codes.block % GROUP_INPUTS[code_format(codes.codes)] == 0 and codes.block <= MAX_BLOCK

    def __init__(self, codes: BlockCodes) -> None:
        n, k = codes.codes.shape
        fmt = code_format(codes.codes)
        group = GROUP_INPUTS[fmt]
        if codes.block % group or codes.block > MAX_BLOCK:  # ``fits``, on the format found here
            raise InvalidArgumentError(
                f"the int8 kernel needs blocks that are a multiple of {group} and at most {MAX_BLOCK} "
                f"for {fmt!r} codes, got {codes.block}"
            )
        panels = -(-n // PANEL_COLS)
        self.in_features, self.out_features, self.block, self.code_format = (
            int(k),
            int(n),
            int(codes.block),
            fmt,
        )
        biased = (codes.codes.astype(np.int16) + np.int16(_BIAS[fmt])).astype(np.uint8)
        # Padding columns hold the biased zero code (their scales are zero).
        padded = np.full((panels * PANEL_COLS, k), _BIAS[fmt], np.uint8)
        padded[:n] = biased
        if fmt == "i8":  # [panels, 16, k/4, 4] -> [panels, k/4, 16, 4]
            groups = padded.reshape(panels, PANEL_COLS, k // 4, 4).transpose(0, 2, 1, 3)
            self.codes = np.ascontiguousarray(groups).reshape(panels, k // 4, 64)
        else:  # [panels, 16, k/8, 2, 4] -> [panels, k/8, 2, 16, 4]: low and high nibble groups
            pairs = padded.reshape(panels, PANEL_COLS, k // 8, 2, 4).transpose(0, 2, 3, 1, 4)
            pairs = np.ascontiguousarray(pairs).reshape(panels, k // 8, 2, 64)
            self.codes = np.ascontiguousarray(pairs[:, :, 0] | (pairs[:, :, 1] << np.uint8(4)))
        self.scales, self.offsets = panel_scales(codes)

    @classmethod
    def from_codes(cls, *parts: BlockCodes) -> DotWeights:
        """One projection of the parts' output features side by side (in order)."""
        return cls(BlockCodes.stack(*parts))

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """``x [t, in]`` (float32) @ the weights with 8-bit activations: fp32 ``[t, out]``. A wrong
        dtype, rank or width raises ``InvalidArgumentError``."""
        if isinstance(x, np.ndarray) and not x.flags.c_contiguous:
            x = np.ascontiguousarray(x)
        return _core.cpu_matmul_dot(
            x, self.codes, self.scales, self.offsets, self.out_features, self.block, self.code_format
        )
