"""A bounded reader of the GGUF container (header, typed key/value metadata, tensor index, data).

``gguf.GGUFReader`` trusts the counts in the file: a metadata array declaring 2**62 elements in a
29-byte file makes it loop on empty reads while memory grows. This reader checks every count,
length and offset against the bytes that remain in the file **before** it reads or allocates
anything: an array of ``n`` elements needs at least ``n`` times its smallest element's encoding, a
string its length, a tensor its ``prod(dims) / block_size * type_size`` bytes inside the data
section. Any failure is a ``ModelLoadError`` naming the offset and the field, so a truncated or
lying file is refused in time and memory proportional to its size. It is also ~30x faster than
``GGUFReader`` on SmolLM2's header (0.2 s against 7 s: no NumPy view per string).

Layout (little-endian; versions 2 and 3): magic ``GGUF``, u32 version, u64 tensor count, u64
metadata count; metadata = (string key, u32 value type, value); a string is u64 length + UTF-8
bytes; an array is u32 element type + u64 count + elements; tensor info = string name, u32 n_dims,
n_dims x u64 dims (ne0 first), u32 GGML type, u64 offset relative to the data section, which
starts at the next multiple of ``general.alignment`` (default 32) after the tensor index.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pagedkv.errors import ModelLoadError

__all__ = ["GGUF_MAGIC", "GgufFile", "TensorInfo", "open_gguf"]

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_NESTING = 4  # arrays of arrays of ...: deeper is refused (no real file nests at all)
# Array elements over all metadata: a real file has under 10**6 (a 262k vocabulary with its
# scores and types); each becomes a Python object (up to ~8x its encoding), so the total is capped.
MAX_METADATA_ELEMENTS = 1 << 25
_HEADER_BYTES = 24  # magic, version, tensor count, metadata count
_U64 = struct.Struct("<Q")

_STRING, _ARRAY, _BOOL = 8, 9, 7
# value type -> (struct format, NumPy dtype) of the fixed-size scalars.
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"),
    1: ("<b", "<i1"),
    2: ("<H", "<u2"),
    3: ("<h", "<i2"),
    4: ("<I", "<u4"),
    5: ("<i", "<i4"),
    6: ("<f", "<f4"),
    _BOOL: ("<B", "<u1"),
    10: ("<Q", "<u8"),
    11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
# The fewest bytes one value of each type occupies: an array's count is bounded by
# remaining bytes // this, before the array is read.
_MIN_VALUE_BYTES = {**{t: struct.calcsize(f) for t, (f, _) in _SCALARS.items()}, _STRING: 8, _ARRAY: 12}
# key string (u64 length, may be empty) + u32 type + the smallest value (1 byte).
_MIN_KV_BYTES = 8 + 4 + 1
# name (u64 length) + n_dims + one dim + type + offset.
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor index, already checked against the file."""

    name: str
    type_id: int  # the GGML type as stored
    type_name: str  # gguf.GGMLQuantizationType name
    dims: tuple[int, ...]  # ne0 first, as stored
    offset: int  # absolute offset in the file
    n_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """Row-major shape (ne_last, ..., ne0): rows of ne0 elements."""
        return tuple(reversed(self.dims))


def _quant_sizes() -> dict[int, tuple[str, int, int]]:
    """GGML type id -> (name, block size in elements, bytes per block), from the gguf package."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    return {
        int(q.value): (q.name, *GGML_QUANT_SIZES[q]) for q in GGMLQuantizationType if q in GGML_QUANT_SIZES
    }


class _Cursor:
    """Reads values from the file's bytes; every read is checked against the end first."""

    def __init__(self, data: mmap.mmap | bytes, path: Path) -> None:
        self.data = data
        self.pos = 0
        self.end = len(data)
        self.path = path
        self.elements_left = MAX_METADATA_ELEMENTS

    def fail(self, what: str) -> ModelLoadError:
        return ModelLoadError(f"{str(self.path)!r} is not a valid GGUF file: {what} (at byte {self.pos})")

    def need(self, n_bytes: int, what: str) -> None:
        if n_bytes > self.end - self.pos:
            raise self.fail(
                f"{what} needs {n_bytes} bytes, {self.end - self.pos} remain (truncated or corrupt)"
            )

    def scalar(self, fmt: str, what: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return value

    def u32(self, what: str) -> int:
        return int(self.scalar("<I", what))

    def u64(self, what: str) -> int:
        return int(self.scalar("<Q", what))

    def string(self, what: str) -> str:
        length = self.u64(f"the length of {what}")
        self.need(length, what)
        raw = self.data[self.pos : self.pos + length]
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise self.fail(f"{what} is not UTF-8 ({error.reason} at byte {error.start})") from None

    def value(self, value_type: int, what: str, depth: int = 0) -> Any:
        if value_type in _SCALARS:
            fmt = _SCALARS[value_type][0]
            value = self.scalar(fmt, what)
            return bool(value) if value_type == _BOOL else value
        if value_type == _STRING:
            return self.string(what)
        if value_type == _ARRAY:
            return self.array(what, depth + 1)
        raise self.fail(f"{what} has unknown value type {value_type}")

    def array(self, what: str, depth: int) -> list[Any]:
        if depth > MAX_ARRAY_NESTING:
            raise self.fail(f"{what} nests arrays deeper than {MAX_ARRAY_NESTING}")
        element_type = self.u32(f"the element type of {what}")
        count = self.u64(f"the element count of {what}")
        if element_type not in _MIN_VALUE_BYTES:
            raise self.fail(f"{what} has unknown element type {element_type}")
        # The bound that keeps a lying count from allocating or looping: every element needs
        # at least this many of the remaining bytes.
        if count > (self.end - self.pos) // _MIN_VALUE_BYTES[element_type]:
            raise self.fail(
                f"{what} declares {count} elements of type {element_type}, more than the "
                f"{self.end - self.pos} remaining bytes can hold"
            )
        self.elements_left -= count
        if self.elements_left < 0:
            raise self.fail(f"the metadata arrays hold more than {MAX_METADATA_ELEMENTS} elements in all")
        if element_type in _SCALARS:
            fmt, dtype = _SCALARS[element_type]
            n_bytes = count * struct.calcsize(fmt)
            values = np.frombuffer(self.data, dtype=dtype, count=count, offset=self.pos).tolist()
            self.pos += n_bytes
            return [bool(v) for v in values] if element_type == _BOOL else values
        if element_type == _STRING:
            return self.strings(count, what)
        return [self.array(f"{what}[{i}]", depth) for i in range(count)]

    def strings(self, count: int, what: str) -> list[str]:
        """``count`` strings: ``string()`` inlined (a vocabulary has ~50k of them), same checks."""
        data, pos, end, unpack = self.data, self.pos, self.end, _U64.unpack_from
        out: list[str] = []
        append = out.append
        try:
            for i in range(count):
                if end - pos < 8:
                    raise self.fail(
                        f"the length of {what}[{i}] needs 8 bytes, {end - pos} remain (truncated)"
                    )
                (length,) = unpack(data, pos)
                pos += 8
                if length > end - pos:
                    raise self.fail(
                        f"{what}[{i}] needs {length} bytes, {end - pos} remain (truncated or corrupt)"
                    )
                append(data[pos : pos + length].decode("utf-8"))
                pos += length
        except UnicodeDecodeError as error:
            raise self.fail(
                f"{what}[{len(out)}] is not UTF-8 ({error.reason} at byte {error.start})"
            ) from None
        finally:
            self.pos = pos
        return out


class GgufFile:
    """A parsed GGUF file: ``metadata`` (plain Python values), ``tensors`` (checked index) and
    the bytes of each tensor, memory-mapped. Use as a context manager, or call ``close()``."""

    def __init__(
        self,
        path: Path,
        data: mmap.mmap,
        version: int,
        metadata: dict[str, Any],
        tensors: dict[str, TensorInfo],
        alignment: int,
        data_offset: int,
    ) -> None:
        self.path = path
        self._data = data
        self.version = version
        self.metadata = metadata
        self.tensors = tensors
        self.alignment = alignment
        self.data_offset = data_offset  # where the data section starts: the header's size

    @property
    def size(self) -> int:
        return len(self._data)

    def header_bytes(self) -> bytes:
        """The header, metadata and tensor index (everything before the data section)."""
        return self._data[: self.data_offset]

    def tensor_bytes(self, info: TensorInfo) -> np.ndarray:
        """A copy of the tensor's bytes (uint8); its bounds were checked when the index was read."""
        return np.frombuffer(self._data, dtype=np.uint8, count=info.n_bytes, offset=info.offset).copy()

    def close(self) -> None:
        self._data.close()

    def __enter__(self) -> GgufFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_gguf(path: str | os.PathLike[str]) -> GgufFile:
    """Parse and check the header, metadata and tensor index of a GGUF file. Raises
    ModelLoadError for a missing, truncated or inconsistent file, in time and memory bounded by
    the file's size."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"model file not found: {str(path)!r}")
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size < _HEADER_BYTES:
                raise ModelLoadError(
                    f"{str(path)!r} is not a GGUF file: {size} bytes, the header alone is 24"
                )
            data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as error:
        raise ModelLoadError(f"cannot read {str(path)!r}: {error}") from error
    try:
        return _parse(path, data)
    except BaseException:
        data.close()
        raise


def _parse(path: Path, data: mmap.mmap) -> GgufFile:
    cursor = _Cursor(data, path)
    if data[:4] != GGUF_MAGIC:
        raise ModelLoadError(f"{str(path)!r} is not a GGUF file (magic {data[:4]!r}, expected b'GGUF')")
    cursor.pos = 4
    version = cursor.u32("the version")
    if version not in SUPPORTED_VERSIONS:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        detail = " (a big-endian file?)" if swapped in SUPPORTED_VERSIONS else ""
        raise ModelLoadError(
            f"{str(path)!r}: unsupported GGUF version {version}{detail}; supported are 2 and 3"
        )
    tensor_count = cursor.u64("the tensor count")
    kv_count = cursor.u64("the metadata count")
    if kv_count > (cursor.end - cursor.pos) // _MIN_KV_BYTES:
        raise cursor.fail(f"the header declares {kv_count} metadata entries, more than the file can hold")
    metadata: dict[str, Any] = {}
    for i in range(kv_count):
        key = cursor.string(f"metadata key #{i}")
        value_type = cursor.u32(f"the type of metadata {key!r}")
        if key in metadata:
            raise cursor.fail(f"metadata key {key!r} appears twice")
        metadata[key] = cursor.value(value_type, f"metadata {key!r}")
    if tensor_count > (cursor.end - cursor.pos) // _MIN_TENSOR_INFO_BYTES:
        raise cursor.fail(f"the header declares {tensor_count} tensors, more than the file can hold")
    quant_sizes = _quant_sizes()
    raw: list[tuple[str, int, str, tuple[int, ...], int, int]] = []
    names: set[str] = set()
    for i in range(tensor_count):
        name = cursor.string(f"the name of tensor #{i}")
        if name in names:
            raise cursor.fail(f"tensor {name!r} appears twice")
        names.add(name)
        n_dims = cursor.u32(f"the dimension count of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cursor.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
        dims = tuple(cursor.u64(f"dimension {d} of tensor {name!r}") for d in range(n_dims))
        type_id = cursor.u32(f"the type of tensor {name!r}")
        relative = cursor.u64(f"the offset of tensor {name!r}")
        if type_id not in quant_sizes:
            raise cursor.fail(f"tensor {name!r} has unknown GGML type id {type_id}")
        type_name, block_size, type_size = quant_sizes[type_id]
        if any(d == 0 for d in dims):
            raise cursor.fail(f"tensor {name!r} has an empty dimension {dims}")
        if dims[0] % block_size:
            raise cursor.fail(
                f"tensor {name!r}: {dims[0]} elements per row is not a multiple of "
                f"{type_name}'s block of {block_size}"
            )
        elements = 1
        for d in dims:  # Python integers: no overflow; the size check below bounds the product
            elements *= d
        raw.append((name, type_id, type_name, dims, relative, elements // block_size * type_size))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        raise cursor.fail(f"general.alignment {alignment!r} is not a positive power of two")
    data_offset = -(-cursor.pos // alignment) * alignment
    if not raw:  # no tensors: a file may end right after its index, without the padding
        data_offset = min(data_offset, cursor.end)
    if data_offset > cursor.end:
        raise cursor.fail(f"the data section would start at {data_offset}, past the end of the file")
    data_bytes = cursor.end - data_offset
    tensors: dict[str, TensorInfo] = {}
    for name, type_id, type_name, dims, relative, n_bytes in raw:
        if relative % alignment:
            raise cursor.fail(f"tensor {name!r} at data offset {relative} is not aligned to {alignment}")
        if relative > data_bytes or n_bytes > data_bytes - relative:
            raise ModelLoadError(
                f"{str(path)!r} is truncated or corrupt: tensor {name!r} ({n_bytes} bytes at data "
                f"offset {relative}) runs past the end of the file ({data_bytes} data bytes)"
            )
        tensors[name] = TensorInfo(name, type_id, type_name, dims, data_offset + relative, n_bytes)
    by_offset = sorted(tensors.values(), key=lambda t: t.offset)
    for before, after in zip(by_offset, by_offset[1:], strict=False):
        if before.offset + before.n_bytes > after.offset:
            raise ModelLoadError(
                f"{str(path)!r} is corrupt: tensors {before.name!r} and {after.name!r} overlap"
            )
    return GgufFile(path, data, version, metadata, tensors, alignment, data_offset)
