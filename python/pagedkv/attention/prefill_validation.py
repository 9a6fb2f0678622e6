"""Argument checks for ``paged_prefill_attention``; they run before any launch.

A prefill call names its block tables in one of two layouts (docs/page_tables.md):

- padded: ``block_tables`` int32 ``[B, max_blocks]``; entries past a sequence's
  ``ceil(seq_len / block_size)`` blocks are ignored (e.g. -1 padding);
- CSR (FlashInfer's paged-KV layout, ``KvCacheManager.csr_page_table``): a tuple
  ``(kv_indptr int32 [B + 1], kv_indices int32 [>= kv_indptr[B]], kv_last_page_len int32 [B])``.
  Each row must describe exactly ``seq_lens[i]`` tokens: ``ceil(seq_len / block_size)`` blocks and
  a last block holding ``kv_last_page_len[i]`` of them (0 for an empty row).

Both are normalised into one ``PageTable``: a flat int32 array of block ids and each row's start
offset into it, which is all the reference and the kernel need. Every used block id is checked to
lie in ``[0, num_blocks)``; every size is checked before anything is allocated, so no input can make
a kernel read out of bounds. Failures raise ``InvalidArgumentError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedkv.attention import validation as val
from pagedkv.errors import InvalidArgumentError

# The kernels index tokens, rows and table entries with int32 arithmetic.
MAX_KERNEL_ENTRIES = 2**31 - 1


@dataclass(frozen=True)
class PageTable:
    """Block tables of B sequences in one form: row i's logical block j is
    ``indices[row_start[i] + j]`` for j < ceil(seq_lens[i] / block_size)."""

    indices: np.ndarray  # int32 [num_entries], host
    row_start: np.ndarray  # int64 [B], host
    layout: str  # "padded" | "csr"


@dataclass(frozen=True)
class PrefillShape:
    num_seqs: int
    total_q: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    group: int  # query heads per KV head
    kind: str  # float16 | bfloat16 | float32 | float64
    scale: float
    causal: bool


@dataclass(frozen=True)
class PrefillArgs:
    """Validated arguments: the tensors (plain ndarrays, or CuPy arrays for backend='cuda') and
    host copies of the integer metadata."""

    q: Any
    k_cache: Any
    v_cache: Any
    seq_lens: np.ndarray  # int32 [B], host
    query_start_loc: np.ndarray  # int32 [B + 1], host
    table: PageTable
    shape: PrefillShape


def require_plain_array(name: str, x: Any, backend: str) -> Any:
    """``x`` as a plain ndarray (subclasses such as np.matrix become ndarrays; masked arrays are
    refused: their mask would be silently dropped). backend='cuda': a CuPy array, returned as is."""
    if backend == "cuda" and val.is_cupy_array(x):
        return x
    if isinstance(x, np.ma.MaskedArray):
        raise InvalidArgumentError(f"{name}: masked arrays are not accepted (the mask would be ignored)")
    if not isinstance(x, np.ndarray):
        want = "a CuPy or NumPy array" if backend == "cuda" else "a NumPy array"
        raise InvalidArgumentError(f"{name} must be {want}, got {type(x).__name__}")
    return np.asarray(x)


def host_int_array(name: str, x: Any, ndim: int, backend: str) -> np.ndarray:
    """An int32 metadata array as a plain, C-contiguous host ndarray of rank ``ndim``."""
    x = require_plain_array(name, x, backend)
    if val.is_cupy_array(x):
        x = x.get()
    if x.dtype != np.int32:
        raise InvalidArgumentError(f"{name} must be int32, got {x.dtype}")
    if x.ndim != ndim:
        raise InvalidArgumentError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")
    if not x.flags.c_contiguous:
        raise InvalidArgumentError(f"{name} must be C-contiguous")
    return x


def _check_tensors(q: Any, k_cache: Any, v_cache: Any, backend: str) -> tuple[Any, Any, Any, str]:
    q = require_plain_array("q", q, backend)
    k_cache = require_plain_array("k_cache", k_cache, backend)
    v_cache = require_plain_array("v_cache", v_cache, backend)
    if backend == "cuda":
        for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            if not val.is_cupy_array(x):
                raise InvalidArgumentError(
                    f"{name}: backend='cuda' takes CuPy arrays, got {type(x).__name__}"
                )
    if q.ndim != 3:
        raise InvalidArgumentError(f"q must be [total_q, num_q_heads, head_dim], got shape {tuple(q.shape)}")
    val.check_cache_shapes(k_cache, v_cache)
    kind = val._kind("q", q, backend)
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise InvalidArgumentError(
            f"q, k_cache and v_cache must share one dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if backend != "numpy":
        val.check_slot_count(int(k_cache.shape[0]), int(k_cache.shape[1]))
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        val._require_contiguous(name, x)
    return q, k_cache, v_cache, kind


def _padded_table(block_tables: Any, seq_lens: np.ndarray, block_size: int, backend: str) -> PageTable:
    tables = host_int_array("block_tables", block_tables, 2, backend)
    num_seqs = int(seq_lens.shape[0])
    if int(tables.shape[0]) != num_seqs:
        raise InvalidArgumentError(
            f"block_tables has {int(tables.shape[0])} rows for {num_seqs} sequences (seq_lens)"
        )
    max_blocks = int(tables.shape[1])
    capacity = max_blocks * block_size
    if num_seqs and int(seq_lens.max()) > capacity:
        b = int(np.argmax(seq_lens))
        raise InvalidArgumentError(
            f"seq_lens[{b}] = {int(seq_lens[b])} exceeds the table's capacity "
            f"{capacity} (max_blocks {max_blocks} x block_size {block_size})"
        )
    if tables.size > MAX_KERNEL_ENTRIES:
        raise InvalidArgumentError("block_tables has more entries than int32 offsets address")
    return PageTable(tables.reshape(-1), np.arange(num_seqs, dtype=np.int64) * max_blocks, layout="padded")


def _csr_table(csr: Any, seq_lens: np.ndarray, block_size: int, backend: str) -> PageTable:
    if len(csr) != 3:
        raise InvalidArgumentError(
            f"a CSR page table is the tuple (kv_indptr, kv_indices, kv_last_page_len), got {len(csr)} items"
        )
    indptr = host_int_array("kv_indptr", csr[0], 1, backend)
    indices = host_int_array("kv_indices", csr[1], 1, backend)
    last = host_int_array("kv_last_page_len", csr[2], 1, backend)
    num_seqs = int(seq_lens.shape[0])
    if int(indptr.shape[0]) != num_seqs + 1 or int(last.shape[0]) != num_seqs:
        raise InvalidArgumentError(
            f"kv_indptr {tuple(indptr.shape)} and kv_last_page_len {tuple(last.shape)} must be "
            f"[B + 1] and [B] for B = {num_seqs} sequences (seq_lens)"
        )
    if int(indptr[0]) != 0:
        raise InvalidArgumentError(f"kv_indptr[0] must be 0, got {int(indptr[0])}")
    pages = np.diff(indptr.astype(np.int64))
    if num_seqs and int(pages.min()) < 0:
        raise InvalidArgumentError("kv_indptr must be non-decreasing")
    if int(indptr[-1]) > int(indices.shape[0]):
        raise InvalidArgumentError(
            f"kv_indptr[B] = {int(indptr[-1])} exceeds len(kv_indices) = {int(indices.shape[0])}"
        )
    lens = seq_lens.astype(np.int64)
    needed = (lens + block_size - 1) // block_size
    bad = np.flatnonzero(pages != needed)
    if bad.size:
        b = int(bad[0])
        raise InvalidArgumentError(
            f"CSR row {b} has {int(pages[b])} blocks but seq_lens[{b}] = {int(lens[b])} needs "
            f"{int(needed[b])} of {block_size} tokens"
        )
    expect_last = np.where(lens == 0, 0, (lens - 1) % block_size + 1)
    bad = np.flatnonzero(last.astype(np.int64) != expect_last)
    if bad.size:
        b = int(bad[0])
        raise InvalidArgumentError(
            f"kv_last_page_len[{b}] = {int(last[b])} disagrees with seq_lens[{b}] = {int(lens[b])} "
            f"(expected {int(expect_last[b])} for block_size {block_size})"
        )
    return PageTable(indices, indptr[:-1].astype(np.int64), layout="csr")


def _check_block_ids(
    table: PageTable,
    seq_lens: np.ndarray,
    block_size: int,
    num_blocks: int,
    first_blocks: np.ndarray | None = None,
) -> None:
    """Every table entry a sequence uses (its blocks from ``first_blocks[i]`` on, when given: a
    sliding window never reads the ones before) names a block of the cache."""
    end = (seq_lens.astype(np.int64) + block_size - 1) // block_size
    first = np.zeros_like(end) if first_blocks is None else np.minimum(first_blocks, end)
    needed = end - first
    total = int(needed.sum())
    if total == 0:
        return
    if num_blocks == 0:
        raise InvalidArgumentError("the caches have no blocks")
    # Positions of every used entry: row_start[i] + 0..needed[i]-1, built without a Python loop.
    rows = np.repeat(np.arange(needed.shape[0]), needed)
    within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(needed) - needed, needed)
    within += first[rows]
    used = table.indices[table.row_start[rows] + within]
    bad = np.flatnonzero((used < 0) | (used >= num_blocks))
    if bad.size:
        i = int(bad[0])
        raise InvalidArgumentError(
            f"sequence {int(rows[i])}'s block {int(within[i])} is {int(used[i])}, "
            f"not a block id in [0, {num_blocks})"
        )


def check_paged_prefill(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    block_tables: Any,
    seq_lens: Any,
    query_start_loc: Any,
    scale: Any,
    causal: Any,
    backend: str,
    window: int | None = None,
) -> PrefillArgs:
    """Validates a paged prefill call (either table layout) and returns its normalised arguments.
    ``window``: an already checked sliding window (``attention.window``); the blocks wholly before
    the window of a sequence's first query are never read, so their entries may be -1."""
    val.check_backend(backend)
    check_causal(causal)
    q, k_cache, v_cache, kind = _check_tensors(q, k_cache, v_cache, backend)
    aligned = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache)]
    return check_prefill_metadata(
        q,
        k_cache,
        v_cache,
        kind,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        causal,
        backend,
        window,
        aligned,
    )


def check_causal(causal: Any) -> None:
    if not isinstance(causal, (bool, np.bool_)):
        raise InvalidArgumentError(f"causal must be a bool, got {type(causal).__name__}")


def check_prefill_metadata(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    kind: str,
    block_tables: Any,
    seq_lens: Any,
    query_start_loc: Any,
    scale: Any,
    causal: Any,
    backend: str,
    window: int | None,
    aligned: list[tuple[str, Any]],
) -> PrefillArgs:
    """The checks of ``check_paged_prefill`` after the tensors': q ``[total_q, num_q_heads,
    head_dim]`` (checked: a plain array of a supported dtype) against the caches' logical shape
    ``[num_blocks, block_size, num_kv_heads, head_dim]`` (an array's, or a ``QuantizedKvCache``'s),
    the lengths, the page table and (kernel backends) the 16-byte alignment of ``aligned``."""
    total_q, num_q_heads, head_dim = (int(s) for s in q.shape)
    num_blocks, block_size, num_kv_heads, cache_head_dim = (int(s) for s in k_cache.shape)
    if cache_head_dim != head_dim:
        raise InvalidArgumentError(f"q head_dim {head_dim} != cache head_dim {cache_head_dim}")
    if min(num_kv_heads, block_size, head_dim, num_q_heads) < 1:
        raise InvalidArgumentError("num_kv_heads, block_size, head_dim and num_q_heads must be >= 1")
    if num_q_heads % num_kv_heads != 0:
        raise InvalidArgumentError(
            f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}"
        )
    group = num_q_heads // num_kv_heads

    lens = host_int_array("seq_lens", seq_lens, 1, backend)
    qsl = host_int_array("query_start_loc", query_start_loc, 1, backend)
    num_seqs = int(lens.shape[0])
    if int(qsl.shape[0]) != num_seqs + 1:
        raise InvalidArgumentError(
            f"query_start_loc must be [B + 1] = [{num_seqs + 1}] for B = {num_seqs} sequences "
            f"(seq_lens), got shape {tuple(qsl.shape)}"
        )
    if int(qsl[0]) != 0:
        raise InvalidArgumentError(f"query_start_loc[0] must be 0, got {int(qsl[0])}")
    q_lens = np.diff(qsl.astype(np.int64))
    if num_seqs and int(q_lens.min()) < 0:
        b = int(np.argmin(q_lens))
        raise InvalidArgumentError(
            f"query_start_loc must be non-decreasing: [{b}] = {int(qsl[b])} > [{b + 1}] = {int(qsl[b + 1])}"
        )
    if int(qsl[-1]) != total_q:
        raise InvalidArgumentError(
            f"query_start_loc[B] = {int(qsl[-1])} must equal total_q = {total_q} (q rows)"
        )
    if num_seqs and int(lens.min()) < 0:
        raise InvalidArgumentError(f"seq_lens must be >= 0, got {int(lens.min())}")
    bad = np.flatnonzero(q_lens > lens)
    if bad.size:
        b = int(bad[0])
        raise InvalidArgumentError(
            f"sequence {b} has {int(q_lens[b])} queries but seq_lens[{b}] = {int(lens[b])}: the new "
            "tokens are part of the context (write their K/V first)"
        )

    if isinstance(block_tables, (tuple, list)):
        table = _csr_table(block_tables, lens, block_size, backend)
    else:
        table = _padded_table(block_tables, lens, block_size, backend)
    first_blocks = None
    if window is not None:
        if not causal:
            raise InvalidArgumentError("window= needs causal=True (a window counts back from each query)")
        # A sequence's earliest query, at seq_len - q_len, sees keys from seq_len - q_len - window + 1
        # on; a sequence without queries reads nothing.
        earliest = np.maximum(lens.astype(np.int64) - q_lens - (window - 1), 0)
        first_blocks = np.where(q_lens > 0, earliest // block_size, np.iinfo(np.int64).max)
    _check_block_ids(table, lens, block_size, num_blocks, first_blocks)

    if backend != "numpy":
        for name, x in aligned:
            val._require_aligned(name, x)
        if num_seqs and int(lens.max()) > val.MAX_KERNEL_SEQ_LEN:
            raise InvalidArgumentError(
                f"seq_lens above {val.MAX_KERNEL_SEQ_LEN} tokens are not supported by the kernels"
            )
        if total_q > MAX_KERNEL_ENTRIES or int(table.indices.shape[0]) > MAX_KERNEL_ENTRIES:
            raise InvalidArgumentError("too many query rows or table entries for int32 kernel indexing")

    shape = PrefillShape(
        num_seqs,
        total_q,
        num_q_heads,
        num_kv_heads,
        head_dim,
        block_size,
        num_blocks,
        group,
        kind,
        val._scale(scale, head_dim),
        bool(causal),
    )
    return PrefillArgs(q, k_cache, v_cache, lens, qsl, table, shape)
