"""The decode benchmark's sweep (``gpu_decode.py``): its points and result rows, the byte
accounting a point's tables must address, the kernel path and split plan the launcher picks, and
the device-time estimate the dry run checks against the budget."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np
from gpu_specs import NOMINAL

BATCHES = (1, 8, 64)
CONTEXTS = (1024, 4096, 16384)
GROUPS = (1, 4, 8)
KINDS = ("float16", "bfloat16")
HEAD_DIM = 128
BLOCK_SIZE = 16
WINDOW = 100  # the windowed DecodeWorkspace correctness case (Gemma-style sliding window)
NUM_KV_HEADS = 8
ITEMSIZE = 2
# (kind, batch, context, group) points whose num_splits is swept, and the counts tried.
SPLIT_SWEEP = (("bfloat16", 1, 16384, 8), ("bfloat16", 8, 4096, 8), ("float16", 1, 1024, 1))
SPLIT_COUNTS = (1, 2, 4, 8, 16, 32)


@dataclass
class SweepPoint:
    kind: str
    batch: int
    context: int
    group: int
    num_kv_heads: int = NUM_KV_HEADS
    head_dim: int = HEAD_DIM
    block_size: int = BLOCK_SIZE

    @property
    def num_q_heads(self) -> int:
        return self.num_kv_heads * self.group

    @property
    def blocks_per_seq(self) -> int:
        return math.ceil(self.context / self.block_size)

    @property
    def kv_bytes(self) -> int:
        """K and V bytes one launch must read: every token of every sequence, once per KV head."""
        return 2 * self.batch * self.context * self.num_kv_heads * self.head_dim * ITEMSIZE

    @property
    def io_bytes(self) -> int:
        """KV plus the query read and the output written."""
        return self.kv_bytes + 2 * self.batch * self.num_q_heads * self.head_dim * ITEMSIZE


@dataclass
class Result:
    point: dict
    kv_gb: float
    time_us: float
    gb_per_s: float
    pct_of_copy: float
    pct_of_peak: float
    num_splits: int
    ctas_per_sm: int = 0
    waves: int = 0
    api_time_us: float | None = None  # the full paged_attention call, wall time, synchronized
    flashinfer_time_us: float | None = None
    flashinfer_gb_per_s: float | None = None
    flashinfer_note: str = ""
    target_pct: float | None = None
    split_sweep_us: dict[str, float] = field(default_factory=dict)  # num_splits -> kernel us
    notes: list[str] = field(default_factory=list)
    kernel: str = ""  # the decode instance the launcher chose (tensor cores or CUDA cores)
    # Where the launcher chose tensor cores: the CUDA-core kernel on the same buffers and plan.
    baseline_kernel: str = ""
    baseline_num_splits: int = 0
    baseline_time_us: float | None = None
    baseline_gb_per_s: float | None = None
    tc_over_cuda_core: float | None = None  # kernel time ratio, tensor cores / CUDA cores
    # The dense baseline on a contiguous cache of the same shapes (gpu_dense_decode.py).
    dense_backend: str = ""
    dense_time_us: float | None = None
    dense_gb_per_s: float | None = None
    dense_over_ours: float | None = None  # > 1: the paged kernel is faster
    dense_note: str = ""


def sweep() -> list[SweepPoint]:
    return [
        SweepPoint(kind, b, c, g) for kind, b, c, g in itertools.product(KINDS, BATCHES, CONTEXTS, GROUPS)
    ]


def target_pct(point: SweepPoint) -> float | None:
    """The targets, in % of the device's peak bandwidth: >= 80 % at >= 0.5 GB of KV for group <= 4,
    >= 65 % at group 8."""
    if point.kv_bytes < 0.5e9:
        return None
    return 80.0 if point.group <= 4 else 65.0


def block_tables(point: SweepPoint, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, int]:
    """Random non-contiguous tables over a pool with 10 % spare blocks: (tables, seq_lens, num_blocks)."""
    used = point.batch * point.blocks_per_seq
    num_blocks = used + max(1, used // 10)
    ids = rng.permutation(num_blocks)[:used].astype(np.int32)
    tables = ids.reshape(point.batch, point.blocks_per_seq)
    lens = np.full(point.batch, point.context, np.int32)
    return tables, lens, num_blocks


def check_accounting(points: list[SweepPoint]) -> None:
    """Dry-run check: the byte formula equals what the tables address, slot by slot."""
    rng = np.random.default_rng(0)
    for p in points:
        tables, lens, num_blocks = block_tables(p, rng)
        row_bytes = p.num_kv_heads * p.head_dim * ITEMSIZE
        addressed = 0
        for b in range(p.batch):
            n = int(lens[b])
            full, rest = divmod(n, p.block_size)
            ids = tables[b, : full + (1 if rest else 0)]
            assert len(set(ids.tolist())) == len(ids) and int(ids.max()) < num_blocks
            addressed += (full * p.block_size + rest) * row_bytes
        assert 2 * addressed == p.kv_bytes, (p, addressed)
        assert len(np.unique(tables)) == tables.size, "blocks shared between sequences"


def has_cuda_core_baseline(kind: str, head_dim: int, group: int) -> bool:
    """Whether the launcher picks tensor cores here, so the CUDA-core kernel is timed beside it."""
    from pagedkv.kernels import instances

    return instances.uses_tensor_cores(kind, head_dim, group)


def kernel_path(point: SweepPoint) -> str:
    """Which decode kernel the launcher runs for this point: tensor cores or CUDA cores."""
    if has_cuda_core_baseline(point.kind, point.head_dim, point.group):
        return "tensor cores (+ CUDA-core baseline)"
    return "CUDA cores"


# estimated_seconds' model: pessimistic on purpose (it is checked against the budget).
EST_BANDWIDTH = 0.5 * (NOMINAL.peak_bytes_per_s or 1e12)  # a launch's bytes at half the expected peak
EST_FLUSH_S = 100e-6  # the L2 flush (2 x 50 MB written) and its host round trip
EST_HOST_S = 100e-6  # per timed iteration: event record/synchronize, Python
EST_MIN_TIMING_S = 0.2  # time_kernel's min_seconds
EST_SETUP_S = 0.5  # random caches (a few GB at most), workspace, plan, frees, per point
EST_COMPILE_S = 5.0  # NVRTC of one instance not yet in the cubin cache
EST_FIXED_S = 30.0  # imports, device query, correctness step (its compiles counted below), copy test


def estimated_seconds(points: list[SweepPoint], kernel_only: bool, flashinfer: bool = True) -> float:
    """An upper estimate of a run's device time: every timing's iterations (time_kernel: at least
    20 and 0.2 s; time_call: 23), setup per point (the dense baseline's tensors included), the
    dense baseline's timing, one compile per decode/merge instance."""
    from pagedkv.kernels import instances

    def timing(p: SweepPoint, min_iters: int = 20) -> float:
        per_iter = p.io_bytes / EST_BANDWIDTH + EST_FLUSH_S + EST_HOST_S
        return max(EST_MIN_TIMING_S, (min_iters + 3) * per_iter)

    total = EST_FIXED_S
    compiled: set[str] = set()
    for p in points:
        total += 2 * EST_SETUP_S + 2 * timing(p)  # ours, and the dense baseline
        for use in (None, False) if has_cuda_core_baseline(p.kind, p.head_dim, p.group) else (None,):
            compiled.add(instances.decode_for(p.kind, p.head_dim, p.block_size, p.group, use).name)
            if use is False:
                total += timing(p)
        compiled.add(instances.merge(p.kind, p.head_dim).name)
        if (p.kind, p.batch, p.context, p.group) in SPLIT_SWEEP:
            total += len(SPLIT_COUNTS) * timing(p, min_iters=10)
        if not kernel_only:
            total += 23 * (p.io_bytes / EST_BANDWIDTH + EST_FLUSH_S + 1e-3)  # time_call: host work
            if flashinfer:
                total += timing(p) + 2.0  # plus its plan and first-call JIT
    return total + EST_COMPILE_S * len(compiled)


def planned(point: SweepPoint, num_sms: int, ctas_per_sm: int) -> tuple[int, int]:
    """(num_splits, waves) the split planner picks for this point."""
    from pagedkv.attention.split_planning import plan_splits
    from pagedkv.kernels import instances

    plan = plan_splits(
        point.batch * point.num_kv_heads,
        point.context,
        instances.tile_tokens(point.kind, point.head_dim),
        num_sms,
        ctas_per_sm,
    )
    return plan.num_splits, plan.waves
