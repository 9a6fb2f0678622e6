"""GGUF block-quantized weights as 8-bit integer codes with a per-block fp32 scale and offset.

A kernel that keeps a file's quantized weights instead of fp32 copies dequantizes each element as
``w = fma(scale, code, offset)``. ``block_codes`` extracts ``(codes, scales, offsets)`` from a
tensor's bytes so that ``fp32(scale * code) + offset`` equals what ``gguf.quants.dequantize``
returns **bit for bit** (NaN payloads aside), for these types:

============  ======  ==========================  ============================  ============
type          block   scale                       offset                        code range
============  ======  ==========================  ============================  ============
Q8_0          32      d                           -0.0                          -128..127
Q4_0          32      d                           -0.0                          -8..7
Q4_1          32      d                           m                             0..15
Q5_0          32      d                           -0.0                          -16..15
Q5_1          32      d                           m                             0..31
Q2_K          16      fp32(d * (sc & 15))         -fp32(dmin * (sc >> 4))       0..3
Q3_K          16      fp32(d * (sc6 - 32))        -0.0                          -4..3
Q4_K          32      fp32(d * sc6)               -fp32(dmin * m6)              0..15
Q5_K          32      fp32(d * sc6)               -fp32(dmin * m6)              0..31
Q6_K          16      fp32(d * sc8)               -0.0                          -32..31
============  ======  ==========================  ============================  ============

(``d``, ``dmin``, ``m``: the block's fp16 fields widened to fp32; ``sc6`` / ``m6``: the K-quants'
packed 6-bit sub-block scales and mins; ``sc8``: Q6_K's signed 8-bit sub-block scales.)

Why this is exact:

- The arithmetic is the reference's own. ``gguf.quants`` computes ``d * q`` (Q8_0, Q4_0 with
  ``q - 8`` already applied to the integer, Q5_0, Q3_K, Q6_K), ``d * q + m`` (Q4_1, Q5_1) or
  ``dl * q - ml`` with ``dl``, ``ml`` rounded to fp32 first (Q2_K, Q4_K, Q5_K). The scale and
  offset here are those same fp32 values, and IEEE 754 defines ``x - y`` as ``x + (-y)``, so
  ``dl * q + (-ml)`` is the reference's result, signed zeros included.
- "No offset" is ``-0.0``, not ``+0.0``: ``x + (-0.0)`` is ``x`` for every ``x``, while
  ``(-0.0) + (+0.0)`` is ``+0.0``, which would turn the reference's ``-0.0`` (``d = -0`` times a
  positive code, or ``d = +0`` times a negative one) into ``+0.0``.
- ``scale * code`` is exact in fp32, so a kernel's single-rounding ``fma`` gives the same value as
  NumPy's product-then-sum: an fp16 significand has 11 bits, a sub-block scale at most 7
  (``|sc8| <= 128``) and then a code at most 5 (``|code| <= 32``), or no sub-block scale and a
  7-bit code (Q8_0): at most 23 significant bits, and the magnitudes (``65504 * 128 * 32 <
  2**28``, smallest nonzero ``2**-24``) stay far inside fp32's normal range. Infinities and NaN
  in ``d`` propagate the same way in both forms (``inf * 0`` is NaN in each).

Not block codes (``block_codes`` returns ``None``; the caller keeps fp32 for them): F32, F16,
BF16 (plain floats), and every other GGUF type: the IQ* and MXFP4/NVFP4 families decode through
lookup grids or float codes, and TQ1_0/TQ2_0 scale 256 elements with one ``d``, a block the
kernel does not take. The codes' element order is the file's: ``codes[r, i]`` is element ``i`` of
row ``r``, rows ``[out_features, in_features]`` as GGUF stores them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pagedkv.errors import InvalidArgumentError, ModelLoadError

if TYPE_CHECKING:
    from pagedkv.models.gguf_reader import GgufFile, TensorInfo

__all__ = ["BLOCK_CODE_TYPES", "BlockCodes", "block_codes", "quantize_q8", "tensor_block_codes"]

# (codes, scales, offsets) of n file blocks: codes [n, elements] int8 (or uint8 below 128, viewed
# as int8), scales and offsets [n, elements // code block] fp32.
_Decoded = tuple[np.ndarray, np.ndarray, np.ndarray]


@dataclass(frozen=True)
class BlockCodes:
    """A matrix ``[rows, in_features]`` whose element ``[r, i]`` is
    ``scales[r, i // block] * codes[r, i] + offsets[r, i // block]`` in fp32."""

    codes: np.ndarray  # int8 [rows, in_features], row-major: rows = out features, as stored
    scales: np.ndarray  # float32 [rows, in_features // block]
    offsets: np.ndarray  # float32 [rows, in_features // block]
    block: int  # elements per scale along in_features

    def __post_init__(self) -> None:
        codes, scales, offsets = self.codes, self.scales, self.offsets
        if not (isinstance(self.block, int) and self.block >= 1):
            raise InvalidArgumentError(f"block must be a positive int, got {self.block!r}")
        if not (isinstance(codes, np.ndarray) and codes.dtype == np.int8 and codes.ndim == 2):
            raise InvalidArgumentError("codes must be a 2-D int8 array")
        rows, cols = codes.shape
        if cols % self.block:
            raise InvalidArgumentError(f"in_features {cols} is not a multiple of the block {self.block}")
        want = (rows, cols // self.block)
        for name, array in (("scales", scales), ("offsets", offsets)):
            if not (isinstance(array, np.ndarray) and array.dtype == np.float32 and array.shape == want):
                raise InvalidArgumentError(f"{name} must be float32 of shape {want}")

    @property
    def shape(self) -> tuple[int, int]:
        """``(rows, in_features)``."""
        rows, cols = self.codes.shape
        return rows, cols

    def dequantize(self) -> np.ndarray:
        """float32 ``[rows, in_features]``: ``scales * codes`` then ``+ offsets``, each rounded to
        fp32 (the product is exact, so this is also what a kernel's fma computes)."""
        rows, cols = self.codes.shape
        n_blocks = cols // self.block
        values = self.codes.reshape(rows, n_blocks, self.block).astype(np.float32)
        with np.errstate(invalid="ignore"):  # an inf scale times code 0 is NaN, as in the reference
            values *= self.scales[:, :, None]
            values += self.offsets[:, :, None]
        return values.reshape(rows, cols)

    def split_blocks(self, block: int) -> BlockCodes:
        """The same values with ``block`` elements per scale (``block`` divides ``self.block``):
        each scale and offset repeated ``self.block // block`` times, the codes shared. Lets
        matrices of different block sizes be fused into one."""
        if not (isinstance(block, int) and block >= 1 and self.block % block == 0):
            raise InvalidArgumentError(f"block {block!r} does not divide the current block {self.block}")
        repeat = self.block // block
        if repeat == 1:
            return self
        return BlockCodes(
            codes=self.codes,
            scales=np.repeat(self.scales, repeat, axis=1),
            offsets=np.repeat(self.offsets, repeat, axis=1),
            block=block,
        )

    @classmethod
    def stack(cls, *parts: BlockCodes) -> BlockCodes:
        """The parts' rows one after another (a fused QKV or gate/up matrix); parts with different
        block sizes are re-expressed in the smallest (``split_blocks``), which changes no value."""
        if not parts:
            raise InvalidArgumentError("BlockCodes.stack needs at least one matrix")
        if len({p.codes.shape[1] for p in parts}) != 1:
            raise InvalidArgumentError(f"stacked matrices differ in width: {[p.codes.shape for p in parts]}")
        block = min(p.block for p in parts)
        same = [p.split_blocks(block) for p in parts]
        return cls(
            codes=np.concatenate([p.codes for p in same]),
            scales=np.concatenate([p.scales for p in same]),
            offsets=np.concatenate([p.offsets for p in same]),
            block=block,
        )


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The little-endian fp16 at byte ``start`` of each block, widened to fp32: ``[n, 1]``."""
    return np.ascontiguousarray(blocks[:, start : start + 2]).view("<f2").astype(np.float32)


def _spread(packed: np.ndarray, width: int, bits: int) -> np.ndarray:
    """Unpack ``bits``-bit fields: each run of ``width`` bytes yields ``8 // bits`` consecutive runs
    of ``width`` elements, the lowest bits first (the layout of every GGUF quant type):
    ``[n, m]`` uint8 -> ``[n, m * 8 // bits]`` uint8."""
    n = packed.shape[0]
    shifts = np.arange(0, 8, bits, dtype=np.uint8).reshape(1, 1, -1, 1)
    fields = (packed.reshape(n, -1, 1, width) >> shifts) & np.uint8((1 << bits) - 1)
    return fields.reshape(n, -1)


def _minus_zero(n: int, groups: int) -> np.ndarray:
    """The offset of a format without one: -0.0 (``x + -0.0 == x`` for every x, -0.0 included)."""
    return np.full((n, groups), -0.0, dtype=np.float32)


def _q8_0(blocks: np.ndarray) -> _Decoded:
    d = _f16(blocks, 0)
    return blocks[:, 2:].view(np.int8), d, _minus_zero(len(blocks), 1)


def _q4_0(blocks: np.ndarray) -> _Decoded:
    codes = _spread(blocks[:, 2:], 16, 4).view(np.int8)
    codes -= np.int8(8)
    return codes, _f16(blocks, 0), _minus_zero(len(blocks), 1)


def _q4_1(blocks: np.ndarray) -> _Decoded:
    return _spread(blocks[:, 4:], 16, 4), _f16(blocks, 0), _f16(blocks, 2)


def _five_bit(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1 codes 0..31: low nibbles from ``qs``, bit ``i`` of the u32 ``qh`` on top."""
    codes = _spread(qs, 16, 4)
    codes |= np.unpackbits(qh, axis=1, bitorder="little") << np.uint8(4)
    return codes


def _q5_0(blocks: np.ndarray) -> _Decoded:
    codes = _five_bit(blocks[:, 2:6], blocks[:, 6:]).view(np.int8)
    codes -= np.int8(16)
    return codes, _f16(blocks, 0), _minus_zero(len(blocks), 1)


def _q5_1(blocks: np.ndarray) -> _Decoded:
    return _five_bit(blocks[:, 4:8], blocks[:, 8:]), _f16(blocks, 0), _f16(blocks, 2)


def _q2_k(blocks: np.ndarray) -> _Decoded:
    # scales[16] (low nibble: scale, high: min), qs[64], d, dmin
    sc = blocks[:, :16]
    scales = _f16(blocks, 80) * (sc & np.uint8(0x0F)).astype(np.float32)
    offsets = -(_f16(blocks, 82) * (sc >> np.uint8(4)).astype(np.float32))
    return _spread(blocks[:, 16:80], 32, 2), scales, offsets


def _q3_k(blocks: np.ndarray) -> _Decoded:
    # hmask[32], qs[64], scales[12] (16 packed 6-bit values), d
    low = _spread(blocks[:, 96:104], 8, 4)  # [n, 16]: low nibbles of scales 0..7, then high ones
    high = _spread(blocks[:, 104:108], 4, 2)  # [n, 16]: the 2-bit tops, 4 per byte
    sc = (low | (high << np.uint8(4))).view(np.int8) - np.int8(32)
    scales = _f16(blocks, 108) * sc.astype(np.float32)
    codes = _spread(blocks[:, 32:96], 32, 2).view(np.int8)
    # A clear hmask bit subtracts 4 (ggml's Q3_K: the bit is set where the code is not shifted).
    codes -= (_spread(blocks[:, :32], 32, 1) ^ np.uint8(1)).view(np.int8) << np.int8(2)
    return codes, scales, _minus_zero(len(blocks), 16)


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 8 six-bit scales and 8 six-bit mins from 12 bytes (``[n, 8]`` uint8 each).
    Bytes 0-3 hold scales 0-3 (low 6 bits) and the tops of scales 4-7; 4-7 the same for the
    mins; 8-11 the low nibbles of scales 4-7 (low) and mins 4-7 (high)."""
    d, m, md = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate(
        [d & np.uint8(0x3F), (md & np.uint8(0x0F)) | ((d >> np.uint8(2)) & np.uint8(0x30))], 1
    )
    mn = np.concatenate([m & np.uint8(0x3F), (md >> np.uint8(4)) | ((m >> np.uint8(2)) & np.uint8(0x30))], 1)
    return sc, mn


def _k_affine(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K sub-block scales ``d * sc`` and offsets ``-(dmin * m)``, ``[n, 8]`` fp32."""
    sc, mn = _k_scales_mins(blocks[:, 4:16])
    scales = _f16(blocks, 0) * sc.astype(np.float32)
    offsets = -(_f16(blocks, 2) * mn.astype(np.float32))
    return scales, offsets


def _q4_k(blocks: np.ndarray) -> _Decoded:
    # d, dmin, scales[12], qs[128]
    scales, offsets = _k_affine(blocks)
    return _spread(blocks[:, 16:], 32, 4), scales, offsets


def _q5_k(blocks: np.ndarray) -> _Decoded:
    # d, dmin, scales[12], qh[32], qs[128]
    scales, offsets = _k_affine(blocks)
    codes = _spread(blocks[:, 48:], 32, 4)
    codes |= _spread(blocks[:, 16:48], 32, 1) << np.uint8(4)
    return codes, scales, offsets


def _q6_k(blocks: np.ndarray) -> _Decoded:
    # ql[128], qh[64], scales[16] (int8), d
    codes = _spread(blocks[:, :128], 64, 4)
    codes |= _spread(blocks[:, 128:192], 32, 2) << np.uint8(4)
    codes = codes.view(np.int8)
    codes -= np.int8(32)
    scales = _f16(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32)
    return codes, scales, _minus_zero(len(blocks), 16)


# type name -> (elements per file block, bytes per file block, elements per scale, decoder).
_TYPES: dict[str, tuple[int, int, int, Callable[[np.ndarray], _Decoded]]] = {
    "Q8_0": (32, 34, 32, _q8_0),
    "Q4_0": (32, 18, 32, _q4_0),
    "Q4_1": (32, 20, 32, _q4_1),
    "Q5_0": (32, 22, 32, _q5_0),
    "Q5_1": (32, 24, 32, _q5_1),
    "Q2_K": (256, 84, 16, _q2_k),
    "Q3_K": (256, 110, 16, _q3_k),
    "Q4_K": (256, 144, 32, _q4_k),
    "Q5_K": (256, 176, 32, _q5_k),
    "Q6_K": (256, 210, 16, _q6_k),
}

BLOCK_CODE_TYPES: tuple[str, ...] = tuple(_TYPES)


def block_codes(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> BlockCodes | None:
    """The codes, scales and offsets of one tensor stored as ``type_name``: ``raw`` is its bytes
    as in the file (uint8, rows of ``shape[1]`` elements), ``shape`` is ``(rows, in_features)``.
    ``None`` when the type is not in ``BLOCK_CODE_TYPES``; ModelLoadError for a shape that is not
    2-D, an ``in_features`` that is not a whole number of the type's blocks, or a byte count that
    does not match the shape (all checked before anything is allocated)."""
    layout = _TYPES.get(type_name)
    if layout is None:
        return None
    elements, block_bytes, block, decode = layout
    if len(shape) != 2 or not all(isinstance(n, (int, np.integer)) and n >= 1 for n in shape):
        raise ModelLoadError(f"{type_name} block codes need a 2-D shape of positive sizes, got {shape}")
    rows, cols = int(shape[0]), int(shape[1])
    if cols % elements:
        raise ModelLoadError(f"{type_name} rows of {cols} elements are not whole blocks of {elements}")
    if not (isinstance(raw, np.ndarray) and raw.dtype == np.uint8):
        raise ModelLoadError(f"{type_name} tensor bytes must be a uint8 array")
    n_blocks = rows * (cols // elements)
    if raw.size != n_blocks * block_bytes:
        raise ModelLoadError(
            f"{type_name} tensor of shape {shape} needs {n_blocks * block_bytes} bytes, got {raw.size}"
        )
    with np.errstate(invalid="ignore"):  # inf * 0 in a sub-block scale is NaN, as in the reference
        codes, scales, offsets = decode(raw.reshape(n_blocks, block_bytes))
    return BlockCodes(
        codes=np.ascontiguousarray(codes.view(np.int8).reshape(rows, cols)),
        scales=np.ascontiguousarray(scales, dtype=np.float32).reshape(rows, cols // block),
        offsets=np.ascontiguousarray(offsets, dtype=np.float32).reshape(rows, cols // block),
        block=block,
    )


def tensor_block_codes(file: GgufFile, info: TensorInfo) -> BlockCodes | None:
    """``block_codes`` of one tensor of an open GGUF file (``None`` without reading its bytes when
    its type has no block codes)."""
    if info.type_name not in _TYPES:
        return None
    shape = info.shape
    if len(shape) != 2:
        raise ModelLoadError(f"tensor {info.name!r} has shape {shape}: block codes need a matrix")
    try:
        return block_codes(file.tensor_bytes(info), info.type_name, (shape[0], shape[1]))
    except ModelLoadError as error:
        raise ModelLoadError(f"tensor {info.name!r}: {error}") from error


def quantize_q8(weight_out_in: np.ndarray, block: int = 32) -> BlockCodes:
    """An fp32 ``[rows, in_features]`` matrix quantized as Q8_0 does (symmetric 8-bit codes,
    ``scale = max|w| / 127`` per block of ``block`` inputs, round to nearest, offset ``-0.0``):
    for models built in memory (tests, random-weight models) to run on the block kernel. Their
    fp32 weights should then be ``quantize_q8(w).dequantize()``, so both weight modes hold the
    same values."""
    w = np.asarray(weight_out_in, dtype=np.float32)
    if w.ndim != 2 or block < 1 or w.shape[1] % block:
        raise InvalidArgumentError(f"cannot quantize shape {w.shape} in blocks of {block}")
    rows, cols = w.shape
    blocks = w.reshape(rows, cols // block, block)
    scales = (np.abs(blocks).max(axis=2) / np.float32(127)).astype(np.float32)
    safe = np.where(scales == 0, np.float32(1), scales)
    codes = np.clip(np.rint(blocks / safe[:, :, None]), -127, 127).astype(np.int8)
    return BlockCodes(codes.reshape(rows, cols), scales, np.full_like(scales, -0.0), block)
