"""Every template instance of the pagedkv kernels, named as C++ expressions.

The same name expressions serve CuPy's ``RawModule(name_expressions=...)``, the emulation
wrappers and the NVRTC compile check, so a kernel the backends can launch is a kernel CI compiles.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.errors import InvalidArgumentError

ATTENTION_SOURCE = "paged_attention.cu"
CACHE_OPS_SOURCE = "cache_ops.cu"
PREFILL_SOURCE = "paged_prefill.cu"
DECODE_MMA_SOURCE = "paged_decode_mma.cu"
QUANT_ATTENTION_SOURCE = "paged_attention_quant.cu"
QUANT_CACHE_OPS_SOURCE = "quant_cache_ops.cu"

# Element type name (as pagedkv names KV dtypes) -> C++ storage type in kv_types.h.
KERNEL_TYPES = {"float32": "float", "float16": "pagedkv::f16", "bfloat16": "pagedkv::bf16"}
HEAD_DIMS = (64, 128, 256)
BLOCK_SIZES = (1, 8, 16, 32)
# Query heads per KV head compiled for; a group size in between runs on the next larger instance
# with the extra heads as padding.
GROUP_INSTANCES = (1, 2, 4, 8)
MAX_GROUP = GROUP_INSTANCES[-1]
DECODE_THREADS = 128  # kDecodeThreads
MERGE_THREADS = 128  # kMergeThreads
COPY_THREADS = 128  # kCopyThreads
VECS_PER_THREAD = 4  # kVecsPerThread
MAX_SPLITS = 256  # kMaxSplits
COPY_UNROLL = 4
# Paged prefill (tensor cores): fp16/bf16 only, head sizes whose fragments fit in registers.
PREFILL_KINDS = ("float16", "bfloat16")
PREFILL_HEAD_DIMS = (64, 128)
PREFILL_THREADS = 128  # kPrefillThreads
PREFILL_ROWS = 64  # kPrefillRows: packed (token, query head) rows per thread block


# Tensor-core decode (paged_decode_mma_kernel): fp16/bf16 caches, the group instances it serves
# (group sizes 3..8 run on instance 4 or 8; n = 8 heads per mma, padded) and its head sizes.
DECODE_MMA_KINDS = ("float16", "bfloat16")
DECODE_MMA_GROUPS = (4, 8)
DECODE_MMA_HEAD_DIMS = (64, 128, 256)
DECODE_MMA_THREADS = 128  # kMmaDecodeThreads


# Quantized caches (kv_cache_dtype -> format traits in kv_quant.h); the query / output / written
# K/V element type is one of KERNEL_TYPES (an int4 cache's residual slots are int8 blocks,
# written by the int8 quantize_kv instance), the block size a runtime argument.
QUANT_FORMATS = {"int8": "pagedkv::QuantInt8", "fp8_e4m3": "pagedkv::QuantFp8", "int4": "pagedkv::QuantInt4"}
QUANT_THREADS = 128  # kQuantThreads, kQuantizeThreads, kSealThreads
QUANT_ROWS = 16  # kQuantRows: packed (token, query head) rows per thread block
QUANT_HEADS_PER_CTA = 4  # quantize_kv_kernel: a warp per head


def quant_tile_tokens(head_dim: int) -> int:
    """Keys per K/V tile of the quantized attention kernel (QuantShape::kTile)."""
    return 2048 // head_dim


def prefill_kv_tile(head_dim: int) -> int:
    """Keys per K/V tile of the prefill kernel (PrefillShape::kKv)."""
    return 64 if head_dim <= 64 else 32


@dataclass(frozen=True)
class Instance:
    """One kernel template instance: the source file defining it and its C++ name expression."""

    source: str
    name: str


def group_instance(group_size: int) -> int:
    """The compiled group size that runs ``group_size`` query heads per KV head."""
    for g in GROUP_INSTANCES:
        if group_size <= g:
            return g
    raise InvalidArgumentError(f"group size {group_size} exceeds the largest compiled group {MAX_GROUP}")


def tile_tokens(kind: str, head_dim: int) -> int:
    """Tokens per tile of the decode kernel (DecodeShape::kTileTokens)."""
    elems_per_vec = 4 if kind == "float32" else 8
    return DECODE_THREADS * VECS_PER_THREAD // (head_dim // elems_per_vec)


def decode(kind: str, head_dim: int, block_size: int, group: int) -> Instance:
    return Instance(
        ATTENTION_SOURCE,
        f"pagedkv::paged_decode_kernel<{KERNEL_TYPES[kind]}, {head_dim}, {block_size}, {group}>",
    )


def decode_mma(kind: str, head_dim: int, block_size: int) -> Instance:
    """The tensor-core decode instance (any group size up to 8; same arguments as decode's)."""
    return Instance(
        DECODE_MMA_SOURCE,
        f"pagedkv::paged_decode_mma_kernel<{KERNEL_TYPES[kind]}, {head_dim}, {block_size}>",
    )


def uses_tensor_cores(kind: str, head_dim: int, group_size: int) -> bool:
    """The launcher's choice rule: tensor cores for fp16/bf16 caches whose group runs on the
    group-4 or group-8 instance (3..8 query heads per KV head), CUDA cores otherwise."""
    return (
        kind in DECODE_MMA_KINDS
        and head_dim in DECODE_MMA_HEAD_DIMS
        and group_instance(group_size) in DECODE_MMA_GROUPS
    )


def decode_for(
    kind: str, head_dim: int, block_size: int, group_size: int, use_tensor_cores: bool | None = None
) -> Instance:
    """The decode instance the launcher runs for this call.

    use_tensor_cores: None follows the rule above (``uses_tensor_cores``); True asks for the
    tensor-core kernel (InvalidArgumentError where it cannot run: fp32, a group outside 3..8, an unsupported
    head size; callers check first and raise a typed error); False always runs the CUDA-core kernel,
    e.g. to measure one path against the other in the same process.
    """
    tensor_cores = uses_tensor_cores(kind, head_dim, group_size)
    if use_tensor_cores is True and not tensor_cores:
        raise InvalidArgumentError(
            f"no tensor-core decode kernel for {kind}, head_dim {head_dim}, group {group_size}"
        )
    if tensor_cores and use_tensor_cores is not False:
        return decode_mma(kind, head_dim, block_size)
    return decode(kind, head_dim, block_size, group_instance(group_size))


def merge(kind: str, head_dim: int) -> Instance:
    return Instance(ATTENTION_SOURCE, f"pagedkv::merge_splits_kernel<{KERNEL_TYPES[kind]}, {head_dim}>")


def write_kv(kind: str, head_dim: int) -> Instance:
    return Instance(CACHE_OPS_SOURCE, f"pagedkv::write_kv_kernel<{KERNEL_TYPES[kind]}, {head_dim}>")


def copy_blocks() -> Instance:
    return Instance(CACHE_OPS_SOURCE, f"pagedkv::copy_blocks_kernel<{COPY_UNROLL}>")


def prefill(kind: str, head_dim: int, block_size: int) -> Instance:
    return Instance(
        PREFILL_SOURCE, f"pagedkv::paged_prefill_kernel<{KERNEL_TYPES[kind]}, {head_dim}, {block_size}>"
    )


def merge_prefill(kind: str, head_dim: int) -> Instance:
    return Instance(PREFILL_SOURCE, f"pagedkv::merge_prefill_splits_kernel<{KERNEL_TYPES[kind]}, {head_dim}>")


def quant_attention(kv_cache_dtype: str, kind: str, head_dim: int) -> Instance:
    """Decode and prefill attention on a quantized cache (any block size, any group up to 8)."""
    return Instance(
        QUANT_ATTENTION_SOURCE,
        "pagedkv::paged_attention_quant_kernel"
        f"<{KERNEL_TYPES[kind]}, {QUANT_FORMATS[kv_cache_dtype]}, {head_dim}>",
    )


def quantize_kv(kv_cache_dtype: str, kind: str, head_dim: int) -> Instance:
    """The write of an 8-bit cache (int8, fp8_e4m3), and the int8 parking of an int4 cache's
    residual tokens: each token's heads quantized into its slot."""
    return Instance(
        QUANT_CACHE_OPS_SOURCE,
        f"pagedkv::quantize_kv_kernel<{KERNEL_TYPES[kind]}, {QUANT_FORMATS[kv_cache_dtype]}, {head_dim}>",
    )


def seal_int4(kind: str, head_dim: int) -> Instance:
    """The seal of int4 blocks that fill (their tokens' int8 values, from the residual slot or
    round-tripped from the write, quantized as a whole)."""
    return Instance(QUANT_CACHE_OPS_SOURCE, f"pagedkv::seal_int4_kernel<{KERNEL_TYPES[kind]}, {head_dim}>")


def threads_per_cta(instance: Instance) -> int:
    """The block size an instance is launched with."""
    if instance.source in (QUANT_ATTENTION_SOURCE, QUANT_CACHE_OPS_SOURCE):
        return QUANT_THREADS
    if "paged_decode_kernel" in instance.name:
        return DECODE_THREADS
    if "paged_decode_mma_kernel" in instance.name:
        return DECODE_MMA_THREADS
    if "merge_splits_kernel" in instance.name:
        return MERGE_THREADS
    if "prefill" in instance.name:
        return PREFILL_THREADS
    return COPY_THREADS


def all_instances() -> list[Instance]:
    """Every instance the backends can launch (what the NVRTC check compiles)."""
    out: list[Instance] = []
    for kind in KERNEL_TYPES:
        for head_dim in HEAD_DIMS:
            for block_size in BLOCK_SIZES:
                for group in GROUP_INSTANCES:
                    # fp16/bf16 groups 4 and 8 run on tensor cores by default; their CUDA-core
                    # instances stay launchable (use_tensor_cores=False), so they are compiled too.
                    out.append(decode(kind, head_dim, block_size, group))
                if kind in DECODE_MMA_KINDS and head_dim in DECODE_MMA_HEAD_DIMS:
                    out.append(decode_mma(kind, head_dim, block_size))
            out.append(merge(kind, head_dim))
            out.append(write_kv(kind, head_dim))
    out.append(copy_blocks())
    for kind in PREFILL_KINDS:
        for head_dim in PREFILL_HEAD_DIMS:
            for block_size in BLOCK_SIZES:
                out.append(prefill(kind, head_dim, block_size))
            out.append(merge_prefill(kind, head_dim))
    out.extend(quant_instances())
    return out


def quant_instances() -> list[Instance]:
    """Every instance of the quantized-cache kernels (the merge they share is merge())."""
    out: list[Instance] = []
    for kind in KERNEL_TYPES:
        for head_dim in HEAD_DIMS:
            for dtype in QUANT_FORMATS:
                out.append(quant_attention(dtype, kind, head_dim))
                if dtype != "int4":
                    out.append(quantize_kv(dtype, kind, head_dim))
            out.append(seal_int4(kind, head_dim))
    return out
