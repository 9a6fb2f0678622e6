"""DecodeWorkspace: decode steps with every buffer allocated once, built for CUDA graph capture.

Why: ``paged_attention(backend="cuda")`` allocates its output and split buffers per call and,
given CuPy tables, validates them on the device (device-to-host syncs). An engine's decode step
already holds its tables and lengths on the host (``KvCacheManager.batch_block_tables`` returns
NumPy arrays), so the workspace splits a step in two, as FlashInfer's decode wrappers do:

- ``plan(block_tables, seq_lens)``: host work. Checks the NumPy metadata against the cache
  geometry given at construction, chooses the split count from the host's max_seq_len, and queues
  one asynchronous copy of tables and lengths (from page-locked staging buffers, used in turn)
  into device buffers of fixed address.
- ``run(q, k_cache, v_cache, out=...)``: launches only. It checks array metadata (shape, dtype,
  layout, address alignment; never contents), allocates nothing when ``out`` is given and never
  reads device memory from the host, so a run can be captured in a CUDA graph and replayed after
  later plans (the graph reads the same device buffers, which each plan refills).

A plan stays valid until the next plan. A captured graph keeps the launch shape and scalar
arguments of the plan before the capture: it may be replayed after any later plan with the same
``DecodePlan.graph_key`` (batch size, split count, tokens per split), and must be captured again
otherwise. ``plan(..., num_splits=N)`` with a fixed N keeps the key stable while lengths grow
within one split size.

Sliding windows: ``DecodeWorkspace(..., window=W)`` fixes the window for the workspace's life, as
``paged_attention(..., window=W)`` takes it per call (same semantics: the query sees its last W
keys; None: all). The window is a constructor argument, not a plan argument, because
- the kernel takes it as a scalar launch argument, which a captured graph freezes: a per-plan
  window would have to join the graph key, and a graph replayed after a plan with another window
  would silently attend over the old one; fixed per workspace, no replay can mix windows;
- it belongs to a layer group, not to a step: the layers of one sliding-window KV group share one
  window, one set of block tables (with -1 at released positions) and so one plan, while a full-
  attention group of the same model has other tables and other splits. An engine holds one
  workspace per KV group and plans each once per step (FlashInfer likewise plans one wrapper per
  window size).
``plan`` then accepts -1 table entries only for blocks wholly before each sequence's window (a
sliding-window group releases those: they are never read), plans the splits over the visible
keys only (``split_planning.visible_tokens``, as ``paged_attention`` does), and every run passes
the window to the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from pagedkv.attention import kernel_launch
from pagedkv.attention import quant_validation as qval
from pagedkv.attention import validation as val
from pagedkv.attention.dtypes import KERNEL_KINDS, kind_of, nan_fill_value
from pagedkv.attention.runners import get_runner
from pagedkv.attention.split_planning import visible_tokens
from pagedkv.attention.window import check_window
from pagedkv.errors import InvalidArgumentError
from pagedkv.kernels import instances
from pagedkv.kernels.instances import Instance

DEFAULT_SPLIT_BYTES = 64 << 20  # fp32 partial outputs of split sequences (FlashInfer uses 128 MiB)
NUM_STAGING = 2  # host staging buffers used in turn: a plan waits only for the upload before last


@dataclass(frozen=True)
class DecodePlan:
    """What ``plan`` decided for the next runs."""

    num_seqs: int
    max_seq_len: int
    num_splits: int
    tokens_per_split: int  # splits * tokens_per_split covers the visible keys (the window's, if any)
    window: int | None = None  # the workspace's sliding window (None: all keys)

    @property
    def graph_key(self) -> tuple[int, int, int]:
        """What a captured run depends on: replay a graph only after plans with an equal key."""
        return (self.num_seqs, self.num_splits, self.tokens_per_split)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise InvalidArgumentError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _host_int32(name: str, x: Any, ndim: int) -> np.ndarray:
    # Plain ndarrays only: a masked array's mask or a matrix's 2-D rows would change what is read.
    if isinstance(x, np.ma.MaskedArray) or isinstance(x, np.matrix):
        raise InvalidArgumentError(f"{name}: masked arrays and matrices are not accepted")
    if not isinstance(x, np.ndarray):
        raise InvalidArgumentError(
            f"{name} must be a NumPy int32 array (host metadata), got {type(x).__name__}"
        )
    if x.dtype != np.int32 or x.ndim != ndim:
        raise InvalidArgumentError(f"{name} must be a {ndim}-D int32 array, got {x.ndim}-D {x.dtype}")
    return x


class DecodeWorkspace:
    """Preallocated buffers for paged decode attention over one cache geometry.

    num_blocks, block_size, num_kv_heads, head_dim, dtype: the caches ``run`` will read
    ([num_blocks, block_size, num_kv_heads, head_dim] of dtype); num_q_heads: query heads;
    max_num_seqs, max_blocks_per_seq: the largest batch and table width ``plan`` accepts;
    split_bytes: room for split partial results (more splits than fit are not planned);
    use_tensor_cores: the decode kernel, as paged_attention's argument (None: the launcher's rule;
    True: the tensor-core kernel, refused where it cannot run; False: the CUDA-core kernel);
    window: sliding window of every plan and run (None: all keys), an int >= 1 as
    ``paged_attention``'s ``window=`` (bools, 0 and negatives are refused; a window longer than
    any sequence means all keys). Fixed per workspace: see the module doc.
    """

    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        num_q_heads: int,
        head_dim: int,
        dtype: Any,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        backend: str = "cuda",
        split_bytes: int = DEFAULT_SPLIT_BYTES,
        use_tensor_cores: bool | None = None,
        window: int | None = None,
    ) -> None:
        self.use_tensor_cores = val.check_use_tensor_cores(use_tensor_cores)
        if val.check_backend(backend) in ("numpy", "cpu"):
            raise InvalidArgumentError("DecodeWorkspace runs kernels: backend must be 'cuda' or 'emulated'")
        self.window = check_window(window, backend)
        self.num_blocks = _positive_int("num_blocks", num_blocks)
        self.block_size = _positive_int("block_size", block_size)
        self.num_kv_heads = _positive_int("num_kv_heads", num_kv_heads)
        self.num_q_heads = _positive_int("num_q_heads", num_q_heads)
        self.head_dim = _positive_int("head_dim", head_dim)
        self.max_num_seqs = _positive_int("max_num_seqs", max_num_seqs)
        self.max_blocks_per_seq = _positive_int("max_blocks_per_seq", max_blocks_per_seq)
        split_bytes = _positive_int("split_bytes", split_bytes)
        if self.max_num_seqs > 65535:
            raise InvalidArgumentError(f"at most 65535 sequences per launch, got max_num_seqs {max_num_seqs}")
        if self.num_q_heads % self.num_kv_heads:
            raise InvalidArgumentError(
                f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}"
            )
        self.kind = kind_of(dtype)
        if self.kind not in KERNEL_KINDS:
            raise InvalidArgumentError(f"dtype {np.dtype(dtype)} is not supported by the kernels")
        self.dtype = np.dtype(dtype)
        val.check_kernel_sizes(self.head_dim, self.block_size, self.num_q_heads // self.num_kv_heads)
        val.check_slot_count(self.num_blocks, self.block_size)
        val.check_tensor_core_choice(
            self.use_tensor_cores, self.kind, self.head_dim, self.num_q_heads // self.num_kv_heads
        )
        table_entries = self.max_num_seqs * self.max_blocks_per_seq
        if table_entries > 1 << 31:
            raise InvalidArgumentError("max_num_seqs x max_blocks_per_seq exceeds 2^31 table entries")
        self.backend = backend
        self._runner = get_runner(backend)
        xp = self._runner.xp
        # Device buffers of fixed address: what a captured graph reads.
        self._tables = xp.zeros((self.max_num_seqs, self.max_blocks_per_seq), dtype=np.int32)
        self._lens = xp.zeros(self.max_num_seqs, dtype=np.int32)
        self._split = xp.empty(max(1, split_bytes // 4), dtype=np.float32)
        # Host staging: tables and lengths packed into one buffer, so a plan is one copy.
        self._staging = [
            self._runner.staging_empty((table_entries + self.max_num_seqs,), np.int32)
            for _ in range(NUM_STAGING)
        ]
        self._staging_tokens: list[Any] = [None] * NUM_STAGING
        self._next_staging = 0
        self._packed = xp.zeros(table_entries + self.max_num_seqs, dtype=np.int32)
        self._plan: DecodePlan | None = None
        self._views: tuple[Any, ...] = ()

    @property
    def current_plan(self) -> DecodePlan | None:
        return self._plan

    @property
    def instance(self) -> Instance:
        """The decode kernel instance the runs launch."""
        return kernel_launch.decode_instance(self._shape(1, self.max_blocks_per_seq, 1.0))

    def ctas_per_sm(self) -> int:
        """Resident CTAs per SM of that kernel, as the split planner sees it."""
        return self._runner.ctas_per_sm(self.instance)

    def max_splits(self, num_seqs: int) -> int:
        """The most splits the split buffers hold for a batch of num_seqs sequences."""
        per_split = max(1, num_seqs) * self.num_q_heads * (self.head_dim + 2)
        return max(1, int(self._split.shape[0]) // per_split)

    def plan(self, block_tables: Any, seq_lens: Any, *, num_splits: int | None = None) -> DecodePlan:
        """Checks host metadata, picks the split count and queues the metadata's upload.

        block_tables: int32 [num_seqs, width <= max_blocks_per_seq] (entries past a sequence's
        ceil(seq_len / block_size) blocks are ignored; with a window, so are the entries of blocks
        wholly before it, which may be -1); seq_lens: int32 [num_seqs].
        """
        tables = _host_int32("block_tables", block_tables, 2)
        lens = _host_int32("seq_lens", seq_lens, 1)
        num_seqs, width = (int(s) for s in tables.shape)
        if num_seqs > self.max_num_seqs or width > self.max_blocks_per_seq:
            raise InvalidArgumentError(
                f"block_tables {tuple(tables.shape)} exceeds the workspace's "
                f"[{self.max_num_seqs}, {self.max_blocks_per_seq}]"
            )
        if num_splits is not None:
            num_splits = _positive_int("num_splits", num_splits)
        shape = self._shape(num_seqs, width, 1.0)
        max_seq_len = val.check_decode_metadata(tables, lens, shape, self.backend, self.window)
        tile = instances.tile_tokens(self.kind, self.head_dim)
        splits, tokens_per_split = kernel_launch.choose_splits(
            num_seqs * self.num_kv_heads,
            visible_tokens(max_seq_len, self.window, tile),
            tile,
            self._runner.num_sms,
            num_splits,
            max_splits=self.max_splits(num_seqs),
            ctas_per_sm=self.ctas_per_sm(),
        )
        # Pack [num_seqs, width] into rows of max_blocks_per_seq entries, then the lengths.
        slot = self._next_staging
        self._next_staging = (slot + 1) % NUM_STAGING
        self._runner.upload_done(self._staging_tokens[slot])
        staging = self._staging[slot]
        table_entries = self.max_num_seqs * self.max_blocks_per_seq
        rows = staging[: num_seqs * self.max_blocks_per_seq].reshape(num_seqs, self.max_blocks_per_seq)
        rows[:, :width] = tables
        rows[:, width:] = -1
        staging[table_entries : table_entries + num_seqs] = lens
        used = num_seqs * self.max_blocks_per_seq
        # Two copies at most: the used table rows, then the lengths.
        self._staging_tokens[slot] = self._runner.upload_async(
            self._tables.reshape(-1)[:used], staging[:used]
        )
        self._staging_tokens[slot] = self._runner.upload_async(
            self._lens[:num_seqs], staging[table_entries : table_entries + num_seqs]
        )
        self._plan = DecodePlan(num_seqs, max_seq_len, splits, tokens_per_split, self.window)
        part = num_seqs * self.num_q_heads * splits
        self._views = (
            self._tables[:num_seqs],
            self._lens[:num_seqs],
            self._split[: part * self.head_dim],
            self._split[part * self.head_dim : part * (self.head_dim + 1)],
            self._split[part * (self.head_dim + 1) : part * (self.head_dim + 2)],
        )
        return self._plan

    def _shape(self, num_seqs: int, max_blocks: int, scale: float) -> val.AttentionShape:
        return val.AttentionShape(
            num_seqs,
            self.num_q_heads,
            self.num_kv_heads,
            self.head_dim,
            self.block_size,
            self.num_blocks,
            max_blocks,
            self.num_q_heads // self.num_kv_heads,
            self.kind,
            scale,
            use_tensor_cores=self.use_tensor_cores,
        )

    def run(self, q: Any, k_cache: Any, v_cache: Any, *, out: Any = None, scale: float | None = None) -> Any:
        """Decode attention of the planned batch: q [num_seqs, num_q_heads, head_dim] -> out.

        Pass ``out`` (same shape and dtype as q, sharing no memory with q or the caches) to launch
        with no allocation at all, e.g. under CUDA graph capture. Reads only array metadata on
        the host.
        """
        plan = self._plan
        if plan is None:
            raise InvalidArgumentError("DecodeWorkspace.run before plan")
        tables, lens, split_out, split_max, split_sum = self._views
        if qval.is_quantized(k_cache, v_cache):
            raise InvalidArgumentError(
                "DecodeWorkspace does not run quantized caches (QuantizedKvCache) yet: use paged_attention"
            )
        if getattr(q, "ndim", 0) == 3 and int(q.shape[0]) != plan.num_seqs:
            raise InvalidArgumentError(f"q has {int(q.shape[0])} sequences, the plan {plan.num_seqs}")
        shape = val.check_decode_arrays(q, k_cache, v_cache, tables, lens, scale, self.backend)
        expected = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        if tuple(k_cache.shape) != expected or k_cache.dtype != self.dtype:
            raise InvalidArgumentError(
                f"k_cache {tuple(k_cache.shape)} {k_cache.dtype} is not the workspace's "
                f"{expected} {self.dtype}"
            )
        if int(q.shape[1]) != self.num_q_heads:
            raise InvalidArgumentError(f"q has {int(q.shape[1])} heads, the workspace {self.num_q_heads}")
        if out is None:
            out = self._runner.xp.empty(tuple(q.shape), dtype=q.dtype)
        else:
            val.check_output("out", out, q, self.backend)
            val.check_no_overlap("out", out, {"q": q, "k_cache": k_cache, "v_cache": v_cache})
        if self._runner.poison:
            out.fill(nan_fill_value(self.kind))
            for buffer in (split_out, split_max, split_sum):
                buffer.fill(np.nan)
        if plan.num_seqs == 0:
            return out
        kernel_launch.launch_decode(
            self._runner,
            out,
            (split_out, split_max, split_sum),
            q,
            k_cache,
            v_cache,
            tables,
            lens,
            replace(shape, max_seq_len=plan.max_seq_len, use_tensor_cores=self.use_tensor_cores),
            self.max_blocks_per_seq,
            plan.num_splits,
            plan.tokens_per_split,
            self.window,
        )
        return out
