"""The engine's KV memory by ``kv_cache_dtype``: what one pool block and one sequence's residual
slots cost, and the pool a byte budget holds.

A pool block holds the K and V of ``layout.layers_per_group`` layers (``kv_layout.py``): at a
quantized dtype its codes and every scale (``pagedkv.attention.kv_block_bytes``), at a plain one
its elements. An ``int4`` engine also keeps each running sequence's open last block in an 8-bit
residual slot, one per KV group and K/V tensor (``residual_bytes_per_sequence``), outside the
pool; ``blocks_for_budget`` sets those aside for ``max_num_seqs`` sequences before it counts
blocks, so a budget in bytes admits exactly what its bytes hold (docs/quantized_kv.md, "Byte
accounting"). Every size of the engine's K/V goes through these functions.

The engine's attention arithmetic runs in ``attention_dtype``: fp32 for the fp32 cache, the
cache's own dtype for a 16-bit one, and ``QUANTIZED_ATTENTION_DTYPE`` (float16) for the quantized
ones, so that a quantized cache differs from the float16 cache only in its storage.
"""

from __future__ import annotations

from pagedkv.attention.kv_cache_dtype import QUANTIZED_DTYPES, kv_block_bytes, residual_bytes
from pagedkv.engine.kv_layout import KvLayout
from pagedkv.errors import InvalidArgumentError

__all__ = [
    "DEFAULT_FULL_CONTEXTS",
    "DEFAULT_KV_CACHE_DTYPE",
    "ENGINE_KV_CACHE_DTYPES",
    "QUANTIZED_ATTENTION_DTYPE",
    "attention_dtype",
    "blocks_for_budget",
    "check_engine_kv_cache_dtype",
    "default_kv_cache_bytes",
    "full_context_blocks",
    "has_residual",
    "pool_block_bytes",
    "residual_bytes_per_sequence",
    "residual_slot_counts",
    "store_key_dtype",
]

# None (the default) is the engine's fp32 cache, as before kv_cache_dtype existed.
DEFAULT_KV_CACHE_DTYPE = "float32"
ENGINE_KV_CACHE_DTYPES = ("float32", "float16", "bfloat16", *QUANTIZED_DTYPES)
# The default pool (EngineConfig.kv_cache_bytes None): this many sequences at the model's full
# context at once, each window group counted at what it holds when allocated per chunk.
DEFAULT_FULL_CONTEXTS = 4
# The attention dtype of every quantized cache (queries, keys and values written, outputs).
QUANTIZED_ATTENTION_DTYPE = "float16"


def check_engine_kv_cache_dtype(kv_cache_dtype: object) -> str:
    """``kv_cache_dtype`` (None: the default) as one of ENGINE_KV_CACHE_DTYPES."""
    if kv_cache_dtype is None:
        return DEFAULT_KV_CACHE_DTYPE
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in ENGINE_KV_CACHE_DTYPES:
        raise InvalidArgumentError(
            f"EngineConfig.kv_cache_dtype must be None or one of {ENGINE_KV_CACHE_DTYPES}, "
            f"got {kv_cache_dtype!r}"
        )
    return kv_cache_dtype


def has_residual(kv_cache_dtype: str) -> bool:
    """Whether sequences keep their open block in a residual slot (int4)."""
    return kv_cache_dtype == "int4"


def attention_dtype(kv_cache_dtype: str) -> str:
    """The element kind of the queries, keys and values the engine's attention calls take
    (``"float32"``, ``"float16"`` or ``"bfloat16"``, the last as uint16 bit patterns)."""
    if kv_cache_dtype in ("float32", "bfloat16"):
        return kv_cache_dtype
    return QUANTIZED_ATTENTION_DTYPE


def residual_slot_counts(kv_cache_dtype: str, max_num_seqs: int, num_host_blocks: int) -> tuple[int, int]:
    """(device, host) residual slots an engine keeps (per KV group): one per running sequence
    (``max_num_seqs``: admission reserves a request's samples within it), and as many on the host
    for sequences preempted by swap (the swap tier exists when ``num_host_blocks > 0``)."""
    if not has_residual(kv_cache_dtype):
        return 0, 0
    return max_num_seqs, max_num_seqs if num_host_blocks else 0


def store_key_dtype(kv_cache_dtype: str) -> str | None:
    """The ``kv_cache_dtype`` a store key carries: a quantized cache's (its blocks are byte
    strings that only the dtype tells apart); None for a plain one (the layout identity, the
    key's salt, names its dtype, and its keys stay what they were)."""
    return kv_cache_dtype if kv_cache_dtype in QUANTIZED_DTYPES else None


def pool_block_bytes(
    layout: KvLayout, block_size: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str
) -> int:
    """Bytes one pool block costs in the device caches: the K and V of ``layers_per_group``
    layers, codes and scales."""
    return kv_block_bytes(kv_cache_dtype, block_size, num_kv_heads, head_dim, layout.layers_per_group)


def residual_bytes_per_sequence(
    layout: KvLayout, block_size: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str
) -> int:
    """Bytes of one running sequence's residual slots (int4: an 8-bit block of K and V per KV
    group and tensor; 0 for every other dtype)."""
    return layout.num_groups * residual_bytes(
        kv_cache_dtype, block_size, num_kv_heads, head_dim, layout.layers_per_group
    )


def blocks_for_budget(
    kv_cache_bytes: int,
    layout: KvLayout,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    kv_cache_dtype: str,
    *,
    max_num_seqs: int,
) -> int:
    """The pool blocks ``kv_cache_bytes`` holds once the residual slots of ``max_num_seqs``
    sequences are set aside (InvalidArgumentError when it does not even hold those)."""
    if isinstance(kv_cache_bytes, bool) or not isinstance(kv_cache_bytes, int) or kv_cache_bytes < 0:
        raise InvalidArgumentError(f"kv_cache_bytes must be a non-negative int, got {kv_cache_bytes!r}")
    residual = max_num_seqs * residual_bytes_per_sequence(
        layout, block_size, num_kv_heads, head_dim, kv_cache_dtype
    )
    if residual > kv_cache_bytes:
        raise InvalidArgumentError(
            f"kv_cache_bytes {kv_cache_bytes} does not hold the residual slots of {max_num_seqs} "
            f"sequences ({residual} bytes)"
        )
    return (kv_cache_bytes - residual) // pool_block_bytes(
        layout, block_size, num_kv_heads, head_dim, kv_cache_dtype
    )


def full_context_blocks(layout: KvLayout, block_size: int, max_model_len: int, max_pass_tokens: int) -> int:
    """The blocks one sequence of ``max_model_len`` tokens holds at most over every KV group
    when blocks are allocated per scheduled chunk: a full-attention group every block; a
    sliding-window group the ``window - 1`` tokens before a pass, the pass's own
    ``max_pass_tokens`` and one block for a window not starting at a block boundary (vLLM's
    admission cap), never more than the whole context."""
    positions = -(-max_model_len // block_size)
    return sum(
        positions if w is None else min(positions, -(-(w - 1 + max_pass_tokens) // block_size) + 1)
        for w in layout.group_windows
    )


def default_kv_cache_bytes(
    layout: KvLayout,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    kv_cache_dtype: str,
    *,
    max_model_len: int,
    max_pass_tokens: int,
    max_num_seqs: int,
) -> int:
    """The default pool's bytes: ``DEFAULT_FULL_CONTEXTS`` sequences at the full context
    (``full_context_blocks``), plus an int4 cache's residual slots for ``max_num_seqs``, so that
    ``blocks_for_budget`` gives back exactly those blocks."""
    blocks = DEFAULT_FULL_CONTEXTS * full_context_blocks(layout, block_size, max_model_len, max_pass_tokens)
    per_block = pool_block_bytes(layout, block_size, num_kv_heads, head_dim, kv_cache_dtype)
    residual = max_num_seqs * residual_bytes_per_sequence(
        layout, block_size, num_kv_heads, head_dim, kv_cache_dtype
    )
    return blocks * per_block + residual
