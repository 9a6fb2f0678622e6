"""KV-cache dtypes and their exact byte accounting: what one block of a cache holds.

A cache tensor (the keys, or the values, of one layer) is a row of bytes per block. The 16- and
32-bit caches hold ``block_size * num_kv_heads * head_dim`` elements per block. A quantized block
(docs/quantized_kv.md) holds its codes and every scale that decodes them, so a block moves
(copy-on-write, swap, offload) as one row of bytes:

- ``"int8"`` / ``"fp8_e4m3"``: ``[block_size, num_kv_heads, head_dim]`` one-byte codes, then one
  UE5M3 scale byte per (token, head), padded to a multiple of 16 bytes;
- ``"int4"`` (KIVI-style): ``[block_size, num_kv_heads, head_dim / 2]`` bytes of two 4-bit codes,
  then one metadata byte per quantization group (keys: per (head, channel), the group spans the
  block's tokens; values: per (token, head)), then three bfloat16 side parameters per head,
  padded to a multiple of 16 bytes. The newest tokens of each sequence (its last, not yet full
  block) live in a *residual* slot per sequence, not in the block: one ``"int8"`` block
  (``RESIDUAL_FORMAT``: int8 codes, a UE5M3 scale per (token, head)) of ``[block_size,
  num_kv_heads, head_dim]``, re-quantized to int4 when the block fills; ``residual_bytes``
  counts it per sequence.

``blocks_for_memory`` turns a KV byte budget into a pool size with both counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.errors import InvalidArgumentError

__all__ = [
    "KV_CACHE_DTYPES",
    "QUANTIZED_DTYPES",
    "RESIDUAL_FORMAT",
    "BlockLayout",
    "block_bytes",
    "block_layout",
    "blocks_for_memory",
    "check_kv_cache_dtype",
    "kv_block_bytes",
    "residual_bytes",
    "sequences_for_memory",
]

QUANTIZED_DTYPES = ("int8", "fp8_e4m3", "int4")
# Element bytes of the unquantized caches (bfloat16 is stored as uint16 bit patterns).
_PLAIN_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}
KV_CACHE_DTYPES = (*_PLAIN_ITEMSIZE, *QUANTIZED_DTYPES)
ROLES = ("key", "value")
ALIGN_BYTES = 16  # every block is whole 16-byte vectors: the copy kernel and the vector loads
INT4_SIDE_PARAMS = 3  # bfloat16 per (block, head): center grid start, center grid step, half-step unit
# The int4 residual slot's format: an 8-bit block, half a 16-bit one (docs/quantized_kv.md, "The
# residual in a paged cache": the int4 capacity goal needs it on Gemma 3).
RESIDUAL_FORMAT = "int8"


def check_kv_cache_dtype(kv_cache_dtype: object) -> str:
    """``kv_cache_dtype`` as one of KV_CACHE_DTYPES; InvalidArgumentError naming it otherwise."""
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
        raise InvalidArgumentError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return kv_cache_dtype


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
    return value


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class BlockLayout:
    """Where the parts of one block of a quantized cache lie, in bytes from the block's start.

    codes: ``[0, codes_bytes)``; group scales / metadata: ``[meta_offset, meta_offset +
    meta_bytes)``; int4 side parameters: ``[side_offset, side_offset + side_bytes)`` (empty for
    the 8-bit formats); ``block_bytes`` (a multiple of 16) includes the zero padding after them.
    """

    kv_cache_dtype: str
    role: str  # "key" | "value" (only int4 quantizes the two differently)
    block_size: int
    num_kv_heads: int
    head_dim: int
    codes_bytes: int
    meta_offset: int
    meta_bytes: int
    side_offset: int
    side_bytes: int
    block_bytes: int


def block_layout(
    kv_cache_dtype: str, role: str, block_size: int, num_kv_heads: int, head_dim: int
) -> BlockLayout:
    """The byte layout of one block of a quantized cache (see the module docstring)."""
    dtype = check_kv_cache_dtype(kv_cache_dtype)
    if dtype not in QUANTIZED_DTYPES:
        raise InvalidArgumentError(f"kv_cache_dtype {dtype!r} is not quantized: it has no block layout")
    if role not in ROLES:
        raise InvalidArgumentError(f"role must be 'key' or 'value', got {role!r}")
    bs = _positive("block_size", block_size)
    heads = _positive("num_kv_heads", num_kv_heads)
    dim = _positive("head_dim", head_dim)
    if dtype == "int4":
        if dim % 2:
            raise InvalidArgumentError(
                f"an int4 cache packs two channels a byte: head_dim must be even, got {dim}"
            )
        codes = bs * heads * dim // 2
        meta = heads * dim if role == "key" else bs * heads
        side_offset = _round_up(codes + meta, 2)
        side = heads * INT4_SIDE_PARAMS * 2
    else:
        codes = bs * heads * dim
        meta = bs * heads
        side_offset = codes + meta
        side = 0
    return BlockLayout(
        dtype,
        role,
        bs,
        heads,
        dim,
        codes,
        codes,
        meta,
        side_offset,
        side,
        _round_up(side_offset + side, ALIGN_BYTES),
    )


def block_bytes(
    kv_cache_dtype: str, block_size: int, num_kv_heads: int, head_dim: int, *, role: str = "key"
) -> int:
    """Bytes of one block of one cache tensor (the keys or the values of one layer), scales
    included. int4 keys and values differ (per-channel vs per-token metadata): ``role`` picks."""
    dtype = check_kv_cache_dtype(kv_cache_dtype)
    if dtype in _PLAIN_ITEMSIZE:
        return (
            _positive("block_size", block_size)
            * _positive("num_kv_heads", num_kv_heads)
            * _positive("head_dim", head_dim)
            * _PLAIN_ITEMSIZE[dtype]
        )
    return block_layout(dtype, role, block_size, num_kv_heads, head_dim).block_bytes


def kv_block_bytes(
    kv_cache_dtype: str, block_size: int, num_kv_heads: int, head_dim: int, num_layers: int = 1
) -> int:
    """Bytes one pool block costs: its keys and values in each of ``num_layers`` layers."""
    layers = _positive("num_layers", num_layers)
    per_layer = sum(
        block_bytes(kv_cache_dtype, block_size, num_kv_heads, head_dim, role=role) for role in ROLES
    )
    return layers * per_layer


def residual_bytes(
    kv_cache_dtype: str,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    num_layers: int = 1,
) -> int:
    """Bytes of one sequence's residual slot (keys and values of its open block in every layer,
    each an 8-bit ``RESIDUAL_FORMAT`` block): an int4 cache needs one per running sequence; 0 for
    every other dtype."""
    if check_kv_cache_dtype(kv_cache_dtype) != "int4":
        return 0
    return (
        2
        * block_bytes(RESIDUAL_FORMAT, block_size, num_kv_heads, head_dim)
        * _positive("num_layers", num_layers)
    )


def blocks_for_memory(
    kv_cache_bytes: int,
    kv_cache_dtype: str,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    num_layers: int = 1,
    *,
    max_num_seqs: int = 0,
) -> int:
    """How many pool blocks fit in ``kv_cache_bytes``: the residual slots of ``max_num_seqs``
    sequences first (int4 only), then whole blocks (codes and scales; ``kv_block_bytes``).
    InvalidArgumentError when the budget does not even hold the residual slots."""
    if isinstance(kv_cache_bytes, bool) or not isinstance(kv_cache_bytes, int) or kv_cache_bytes < 0:
        raise InvalidArgumentError(f"kv_cache_bytes must be a non-negative int, got {kv_cache_bytes!r}")
    if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 0:
        raise InvalidArgumentError(f"max_num_seqs must be a non-negative int, got {max_num_seqs!r}")
    residual = max_num_seqs * residual_bytes(kv_cache_dtype, block_size, num_kv_heads, head_dim, num_layers)
    if residual > kv_cache_bytes:
        raise InvalidArgumentError(
            f"kv_cache_bytes {kv_cache_bytes} does not hold the residual slots of {max_num_seqs} "
            f"sequences ({residual} bytes)"
        )
    return (kv_cache_bytes - residual) // kv_block_bytes(
        kv_cache_dtype, block_size, num_kv_heads, head_dim, num_layers
    )


def sequences_for_memory(
    kv_cache_bytes: int,
    context_tokens: int,
    kv_cache_dtype: str,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    num_layers: int = 1,
) -> int:
    """The most sequences of ``context_tokens`` tokens each that ``kv_cache_bytes`` holds: each
    costs ``ceil(context_tokens / block_size)`` blocks and (int4) one residual slot. The byte
    arithmetic only; an engine's admission rules (watermarks, prefill peaks) come on top."""
    tokens = _positive("context_tokens", context_tokens)
    per_sequence = -(-tokens // _positive("block_size", block_size)) * kv_block_bytes(
        kv_cache_dtype, block_size, num_kv_heads, head_dim, num_layers
    ) + residual_bytes(kv_cache_dtype, block_size, num_kv_heads, head_dim, num_layers)
    if isinstance(kv_cache_bytes, bool) or not isinstance(kv_cache_bytes, int) or kv_cache_bytes < 0:
        raise InvalidArgumentError(f"kv_cache_bytes must be a non-negative int, got {kv_cache_bytes!r}")
    return kv_cache_bytes // per_sequence
