"""Argument checks shared by every backend; they run before any launch.

Everything an attention kernel would trust is checked here: dtypes, ranks, shapes, C-contiguity,
alignment, block ids in the used part of each block table (padding past a sequence's blocks is
ignored, whatever it holds), seq_lens against table capacity. The cache operations' checks (slots,
copy/swap block ids) are in ``cache_op_validation.py``, built on this file's array checks. A
failure raises ``InvalidArgumentError`` and nothing is launched, so no input can make a kernel
read or write out of bounds.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedkv.attention.dtypes import KERNEL_KINDS, REFERENCE_KINDS, kind_of
from pagedkv.errors import InvalidArgumentError
from pagedkv.kernels import instances

BACKENDS = ("numpy", "cpu", "cuda", "emulated")
MAX_KERNEL_SEQ_LEN = 1 << 30  # keeps the kernels' int token arithmetic (split ends, tile steps) in range
# The tensor-core kernels (decode and prefill) number a token's cache slot (block id * block_size +
# offset) in 32 unsigned bits (kv_tile_gather.h): a cache of 2**32 slots or more would wrap.
MAX_KERNEL_SLOTS = 1 << 32


@dataclass(frozen=True)
class AttentionShape:
    num_seqs: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    max_blocks: int
    group: int  # query heads per KV head
    kind: str  # float16 | bfloat16 | float32 | float64
    scale: float
    max_seq_len: int = 0  # longest sequence of the call, known on the host (0: none or unknown)
    use_tensor_cores: bool | None = None  # decode kernel: None = the launcher's rule (see instances)


def unwrap_ndarray_subclass(name: str, x: Any) -> Any:
    """``x`` as a plain ``numpy.ndarray`` when it is an ndarray subclass; anything else unchanged
    (the checks after it report a wrong type).

    Validation must see the values a kernel or the NumPy reference will use. A subclass can
    override ``min``/``max``/``any``/``tolist`` (a ``numpy.ma.MaskedArray`` skips masked entries,
    and its ``tolist`` gives ``None``, which as an index broadcasts over a whole cache), so every
    subclass is viewed through ``np.asarray`` (no copy: in-place writes still land in its memory).
    Masked arrays are refused outright: their masked entries have no defined value.
    """
    if isinstance(x, np.ma.MaskedArray):
        raise InvalidArgumentError(
            f"{name} is a masked array: pass a plain ndarray (masked entries have no defined value)"
        )
    if isinstance(x, np.ndarray) and type(x) is not np.ndarray:
        return np.asarray(x)
    return x


def unwrap_ndarray_subclasses(name: str, xs: Any) -> Any:
    """``unwrap_ndarray_subclass`` over each element of a list or tuple of per-layer caches (``xs`` unchanged
    when it is neither: the validation reports that)."""
    if isinstance(xs, (list, tuple)):
        return [unwrap_ndarray_subclass(f"{name}[{i}]", x) for i, x in enumerate(xs)]
    return xs


def check_num_splits(num_splits: Any) -> int | None:
    """``num_splits`` as an int >= 1 (or None); bools, floats and values < 1 are refused."""
    if num_splits is None:
        return None
    if isinstance(num_splits, (bool, np.bool_)) or not isinstance(num_splits, (int, np.integer)):
        raise InvalidArgumentError(f"num_splits must be a positive integer, got {num_splits!r}")
    value = int(num_splits)
    if value < 1:
        raise InvalidArgumentError(f"num_splits must be a positive integer, got {value}")
    return value


def check_use_tensor_cores(use_tensor_cores: Any) -> bool | None:
    """``use_tensor_cores`` as True, False or None. Python and NumPy bools are accepted (both say
    one thing); ints such as 0/1, strings and arrays are refused: ``"false"`` or ``np.array([1])``
    would otherwise read as a choice nobody made."""
    if use_tensor_cores is None:
        return None
    if isinstance(use_tensor_cores, (bool, np.bool_)):
        return bool(use_tensor_cores)
    raise InvalidArgumentError(
        f"use_tensor_cores must be True, False or None, got {type(use_tensor_cores).__name__} "
        f"{use_tensor_cores!r}"
    )


def check_tensor_core_choice(use_tensor_cores: bool | None, kind: str, head_dim: int, group: int) -> None:
    """use_tensor_cores=True where the tensor-core decode kernel cannot run is refused: it serves
    fp16/bf16 caches, 3..8 query heads per KV head and head sizes instances.DECODE_MMA_HEAD_DIMS."""
    if use_tensor_cores is not True:
        return
    if not 1 <= group <= instances.MAX_GROUP or not instances.uses_tensor_cores(kind, head_dim, group):
        raise InvalidArgumentError(
            f"use_tensor_cores=True: no tensor-core decode kernel for {kind} caches, head_dim "
            f"{head_dim}, {group} query heads per KV head (it runs {'/'.join(instances.DECODE_MMA_KINDS)} "
            f"caches, 3..{instances.MAX_GROUP} query heads per KV head, head_dim in "
            f"{instances.DECODE_MMA_HEAD_DIMS}); pass None or False"
        )


def check_cache_shapes(k_cache: Any, v_cache: Any) -> None:
    """The paged cache layout: ``k_cache`` 4-D ``[num_blocks, block_size, num_kv_heads,
    head_dim]`` and ``v_cache`` of the same shape."""
    if k_cache.ndim != 4:
        raise InvalidArgumentError(
            "k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(k_cache.shape)}"
        )
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise InvalidArgumentError(
            f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}"
        )


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise InvalidArgumentError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def is_cupy_array(x: Any) -> bool:
    return type(x).__module__.startswith("cupy")


def _require_array(name: str, x: Any, backend: str) -> None:
    if backend == "cuda":
        if not is_cupy_array(x):
            raise InvalidArgumentError(f"{name}: backend='cuda' takes CuPy arrays, got {type(x).__name__}")
    elif not isinstance(x, np.ndarray):
        raise InvalidArgumentError(f"{name}: backend={backend!r} takes NumPy arrays, got {type(x).__name__}")


def _require_contiguous(name: str, x: Any) -> None:
    if not x.flags.c_contiguous:
        raise InvalidArgumentError(f"{name} must be C-contiguous")


def _require_writable(name: str, x: Any) -> None:
    # A kernel writes through the raw pointer and would not notice NumPy's flag: a read-only view
    # may be backed by immutable memory (a bytes object, a read-only mmap). CuPy arrays have no
    # such flag and are always writable.
    flags = getattr(x, "flags", None)
    if flags is not None and not getattr(flags, "writeable", True):
        raise InvalidArgumentError(f"{name} is read-only: it is written in place")


def _require_int(name: str, x: Any, dtype: type, ndim: int) -> None:
    if x.dtype != np.dtype(dtype):
        raise InvalidArgumentError(f"{name} must be {np.dtype(dtype).name}, got {x.dtype}")
    if x.ndim != ndim:
        raise InvalidArgumentError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")
    _require_contiguous(name, x)


def _data_address(x: Any) -> int:
    return int(x.data.ptr) if is_cupy_array(x) else int(x.ctypes.data)


def _require_aligned(name: str, x: Any) -> None:
    if _data_address(x) % 16 != 0:
        raise InvalidArgumentError(f"{name} must start on a 16-byte boundary (kernels use 16-byte vectors)")


def _kind(name: str, x: Any, backend: str) -> str:
    try:
        kind = kind_of(x.dtype)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{name}: {exc}") from None
    allowed = REFERENCE_KINDS if backend == "numpy" else KERNEL_KINDS
    if kind not in allowed:
        raise InvalidArgumentError(f"{name}: dtype {x.dtype} is not supported by backend={backend!r}")
    return kind


def _scale(scale: Any, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise InvalidArgumentError(f"scale must be a real number, got {type(scale).__name__}")
    try:
        value = float(scale)
    except OverflowError:
        raise InvalidArgumentError(
            f"scale must be finite, got an int of {int(scale).bit_length()} bits"
        ) from None
    if not math.isfinite(value):
        raise InvalidArgumentError(f"scale must be finite, got {value}")
    return value


def check_slot_count(num_blocks: int, block_size: int) -> None:
    """A cache the kernels can address: ``num_blocks * block_size < 2**32`` (MAX_KERNEL_SLOTS).
    Shapes only, so it runs before anything is read or allocated."""
    if num_blocks * block_size >= MAX_KERNEL_SLOTS:
        raise InvalidArgumentError(
            f"a cache of {num_blocks} blocks x {block_size} tokens has {num_blocks * block_size} slots: "
            f"the kernels address at most 2**32 - 1 (32-bit slot numbers)"
        )


def _address_range(x: Any) -> tuple[int, int]:
    start = _data_address(x)
    return start, start + int(x.nbytes)


def check_no_overlap(name: str, out: Any, inputs: dict[str, Any]) -> None:
    """An output a kernel writes must not share memory with an array the same launch reads: the
    kernel would read values it (or another thread block) already overwrote. C-contiguous arrays
    of one kind (all NumPy or all CuPy) are compared by address range (metadata only)."""
    o0, o1 = _address_range(out)
    if o0 == o1:
        return
    for other_name, x in inputs.items():
        if is_cupy_array(x) != is_cupy_array(out):
            continue  # host and device memory never overlap
        a0, a1 = _address_range(x)
        if a0 < o1 and o0 < a1:
            raise InvalidArgumentError(
                f"{name} overlaps {other_name} in memory: pass a separate output array"
            )


def check_kernel_sizes(head_dim: int, block_size: int, group: int) -> None:
    if head_dim not in instances.HEAD_DIMS:
        raise InvalidArgumentError(
            f"head_dim {head_dim} has no compiled kernel (supported: {instances.HEAD_DIMS})"
        )
    if block_size not in instances.BLOCK_SIZES:
        raise InvalidArgumentError(
            f"block_size {block_size} has no compiled kernel (supported: {instances.BLOCK_SIZES})"
        )
    if group > instances.MAX_GROUP:
        raise InvalidArgumentError(
            f"{group} query heads per KV head exceeds the largest compiled group ({instances.MAX_GROUP})"
        )


def _int(x: Any) -> int:
    return int(x.item()) if hasattr(x, "item") else int(x)


def check_paged_attention(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    block_tables: Any,
    seq_lens: Any,
    scale: Any,
    backend: str,
    window: int | None = None,
) -> AttentionShape:
    """Validates a paged decode-attention call and returns its sizes (``max_seq_len`` included).

    With a sliding ``window`` (already checked, see ``attention.window``) the table entries of
    blocks wholly before the window are never read and may be -1.

    backend='cuda' takes block_tables and seq_lens as NumPy arrays (the host metadata the caller
    already has, e.g. from ``KvCacheManager.batch_block_tables``: checked on the host, no
    device-to-host sync) or as CuPy arrays (checked on the device: several syncs per call).
    """
    shape = check_decode_arrays(q, k_cache, v_cache, block_tables, seq_lens, scale, backend)
    if backend == "cuda" and is_cupy_array(block_tables) != is_cupy_array(seq_lens):
        raise InvalidArgumentError("block_tables and seq_lens must both be NumPy or both be CuPy arrays")
    if is_cupy_array(block_tables):
        max_seq_len = check_decode_metadata_on_device(block_tables, seq_lens, shape, backend, window)
    else:
        max_seq_len = check_decode_metadata(block_tables, seq_lens, shape, backend, window)
    return dataclasses.replace(shape, max_seq_len=max_seq_len)


def check_decode_arrays(
    q: Any, k_cache: Any, v_cache: Any, block_tables: Any, seq_lens: Any, scale: Any, backend: str
) -> AttentionShape:
    """Everything about a decode call that array metadata shows (types, shapes, dtypes, layout,
    alignment): never reads array contents, so it costs no device-to-host sync."""
    check_backend(backend)
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _require_array(name, x, backend)
    for name, x in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if backend == "cuda" and isinstance(x, np.ndarray):
            continue  # host metadata, checked on the host
        _require_array(name, x, backend)
    if q.ndim != 3:
        raise InvalidArgumentError(f"q must be [num_seqs, num_q_heads, head_dim], got shape {tuple(q.shape)}")
    check_cache_shapes(k_cache, v_cache)
    kind = _kind("q", q, backend)
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise InvalidArgumentError(
            f"q, k_cache and v_cache must share one dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    num_seqs, num_q_heads, head_dim = (int(s) for s in q.shape)
    num_blocks, block_size, num_kv_heads, cache_head_dim = (int(s) for s in k_cache.shape)
    if cache_head_dim != head_dim:
        raise InvalidArgumentError(f"q head_dim {head_dim} != cache head_dim {cache_head_dim}")
    if num_kv_heads < 1 or block_size < 1 or head_dim < 1 or num_q_heads < 1:
        raise InvalidArgumentError("num_kv_heads, block_size, head_dim and num_q_heads must be >= 1")
    if num_q_heads % num_kv_heads != 0:
        raise InvalidArgumentError(
            f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}"
        )
    group = num_q_heads // num_kv_heads
    if backend != "numpy":
        check_slot_count(num_blocks, block_size)
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _require_contiguous(name, x)
    _require_int("block_tables", block_tables, np.int32, 2)
    _require_int("seq_lens", seq_lens, np.int32, 1)
    if int(block_tables.shape[0]) != num_seqs or int(seq_lens.shape[0]) != num_seqs:
        raise InvalidArgumentError(
            f"block_tables {tuple(block_tables.shape)} and seq_lens {tuple(seq_lens.shape)} must have "
            f"num_seqs = {num_seqs} rows"
        )
    max_blocks = int(block_tables.shape[1])
    if backend != "numpy":
        check_kernel_sizes(head_dim, block_size, group)
        for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            _require_aligned(name, x)
        if num_seqs > 65535:
            raise InvalidArgumentError(f"at most 65535 sequences per launch, got {num_seqs}")
    return AttentionShape(
        num_seqs,
        num_q_heads,
        num_kv_heads,
        head_dim,
        block_size,
        num_blocks,
        max_blocks,
        group,
        kind,
        _scale(scale, head_dim),
    )


def check_decode_metadata(
    block_tables: Any, seq_lens: Any, shape: AttentionShape, backend: str, window: int | None = None
) -> int:
    """Checks host (NumPy) block tables and lengths against the caches; returns max_seq_len.

    Only the used part of each table row (ceil(seq_len / block_size) entries, less the blocks
    wholly before a sliding ``window``) must hold block ids in [0, num_blocks); padding past it is
    never read. Reads host memory only.
    """
    if not isinstance(block_tables, np.ndarray) or not isinstance(seq_lens, np.ndarray):
        raise InvalidArgumentError("block_tables and seq_lens must be NumPy arrays (host metadata)")
    _require_int("block_tables", block_tables, np.int32, 2)
    _require_int("seq_lens", seq_lens, np.int32, 1)
    num_seqs = int(seq_lens.shape[0])
    if int(block_tables.shape[0]) != num_seqs:
        raise InvalidArgumentError(
            f"block_tables {tuple(block_tables.shape)} and seq_lens {tuple(seq_lens.shape)} must have "
            "one row per sequence"
        )
    if num_seqs == 0:
        return 0
    first_blocks = None
    if window is not None:  # the query at position seq_len - 1 sees keys from seq_len - window on
        first_blocks = np.maximum(seq_lens.astype(np.int64) - window, 0) // shape.block_size
    return _check_lengths_and_tables(
        np, block_tables, seq_lens, shape, backend, int(seq_lens.min()), int(seq_lens.max()), first_blocks
    )


def check_decode_metadata_on_device(
    block_tables: Any, seq_lens: Any, shape: AttentionShape, backend: str, window: int | None = None
) -> int:
    """check_decode_metadata for CuPy tables and lengths: the same checks run on the device and
    their verdicts come back to the host (several device-to-host syncs). Returns max_seq_len."""
    num_seqs = int(seq_lens.shape[0])
    if num_seqs == 0:
        return 0
    xp = _xp(block_tables)
    low, high = (int(v) for v in xp.stack([seq_lens.min(), seq_lens.max()]).get())
    first_blocks = None
    if window is not None:
        first_blocks = xp.maximum(seq_lens.astype(np.int64) - window, 0) // shape.block_size
    return _check_lengths_and_tables(xp, block_tables, seq_lens, shape, backend, low, high, first_blocks)


def _check_lengths_and_tables(
    xp: Any,
    block_tables: Any,
    seq_lens: Any,
    shape: AttentionShape,
    backend: str,
    low: int,
    high: int,
    first_blocks: Any = None,
) -> int:
    """The checks check_decode_metadata and its device twin share, on ``xp`` arrays whose lengths
    span [low, high]: lengths within the kernels' range and the tables' capacity, and every used
    table entry (from ``first_blocks[b]`` on when given) a block id. Returns high (the max_seq_len)."""
    max_blocks = int(block_tables.shape[1])
    block_size = shape.block_size
    if backend != "numpy" and high > MAX_KERNEL_SEQ_LEN:
        raise InvalidArgumentError(
            f"seq_lens above {MAX_KERNEL_SEQ_LEN} tokens are not supported by the kernels"
        )
    capacity = max_blocks * block_size
    if low < 0 or high > capacity:
        raise InvalidArgumentError(
            f"seq_lens must lie in [0, {capacity}] (max_blocks {max_blocks} x block_size {block_size})"
        )
    if max_blocks and shape.num_blocks * block_size == 0 and high > 0:
        raise InvalidArgumentError("the caches have no blocks")
    if max_blocks:
        used_blocks = (seq_lens.astype(np.int64) + block_size - 1) // block_size  # [num_seqs]
        used = xp.arange(max_blocks)[None, :] < used_blocks[:, None]
        if first_blocks is not None:
            used &= xp.arange(max_blocks)[None, :] >= first_blocks[:, None]
        bad = used & ((block_tables < 0) | (block_tables >= shape.num_blocks))
        if bool(bad.any()):
            b, i = (int(t) for t in xp.argwhere(bad)[0])
            raise InvalidArgumentError(
                f"block_tables[{b}, {i}] = {_int(block_tables[b, i])} "
                f"is not a block id in [0, {shape.num_blocks})"
            )
    return high


def check_output(name: str, out: Any, like: Any, backend: str) -> None:
    """A caller-provided output array: the same array kind, shape and dtype as ``like``, C-contiguous,
    writable and 16-byte aligned (metadata only)."""
    _require_array(name, out, backend)
    if tuple(out.shape) != tuple(like.shape) or out.dtype != like.dtype:
        raise InvalidArgumentError(
            f"{name} must be {tuple(like.shape)} {like.dtype}, got {tuple(out.shape)} {out.dtype}"
        )
    _require_contiguous(name, out)
    _require_writable(name, out)
    _require_aligned(name, out)


def check_contiguous_attention(q: Any, k: Any, v: Any, scale: Any, backend: str) -> AttentionShape:
    """Validates one sequence's contiguous attention; max_blocks/num_blocks are 1/0 placeholders."""
    check_backend(backend)
    for name, x in (("q", q), ("k", k), ("v", v)):
        _require_array(name, x, backend)
    if q.ndim != 2:
        raise InvalidArgumentError(f"q must be [num_q_heads, head_dim], got shape {tuple(q.shape)}")
    if k.ndim != 3:
        raise InvalidArgumentError(f"k must be [seq_len, num_kv_heads, head_dim], got shape {tuple(k.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise InvalidArgumentError(f"v shape {tuple(v.shape)} != k shape {tuple(k.shape)}")
    kind = _kind("q", q, backend)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise InvalidArgumentError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    num_q_heads, head_dim = (int(s) for s in q.shape)
    seq_len, num_kv_heads, k_head_dim = (int(s) for s in k.shape)
    if k_head_dim != head_dim:
        raise InvalidArgumentError(f"q head_dim {head_dim} != k head_dim {k_head_dim}")
    if num_kv_heads < 1 or head_dim < 1 or num_q_heads % num_kv_heads != 0:
        raise InvalidArgumentError(
            f"num_q_heads {num_q_heads} must be a positive multiple of num_kv_heads {num_kv_heads}"
        )
    group = num_q_heads // num_kv_heads
    if backend != "numpy":
        check_kernel_sizes(head_dim, 16, group)
    return AttentionShape(
        1, num_q_heads, num_kv_heads, head_dim, 1, 0, 1, group, kind, _scale(scale, head_dim)
    )


def _xp(x: Any) -> Any:
    """The array module of x: NumPy, or the CuPy-like package that defines its type."""
    if is_cupy_array(x):
        # CuPy is optional, so imported here; naming it from the type also serves test stand-ins.
        return importlib.import_module(type(x).__module__.split(".")[0])
    return np
