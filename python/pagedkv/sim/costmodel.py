"""Recompute or swap? The cost of bringing a preempted sequence back, modelled and measured.

A preempted sequence of ``context_tokens`` tokens can be brought back two ways:

* **recompute**: drop its KV cache and run the prefill over the whole context again when it is
  resumed. Cost = prefill FLOPs / FLOP rate; the FLOPs grow linearly (projections, MLP) plus
  quadratically (causal attention) with the context.
* **swap**: copy its blocks to host memory and back. Cost, for both directions,
  ``2 * (bytes / link_bandwidth + copies * per_transfer_latency)``; the KV cache is laid out per
  layer with separate K and V tensors (docs/design.md, KV layouts), so one block is ``2 * num_layers`` copies,
  and a whole last block is moved even when partly filled.

Swap pays a latency per block, recompute does not: with tiny blocks swapping loses, with large
blocks it wins beyond some context. `CostModel.crossover_context_tokens` finds that point.

`pagedkv.sim.cpu_calibration` measures both for real on this CPU and fits this model's
parameters to the measurements.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from pagedkv.errors import InvalidArgumentError

__all__ = [
    "DTYPE_BYTES",
    "ModelShape",
    "Hardware",
    "CostModel",
    "LLAMA3_8B",
    "H200_PCIE5",
    "DEFAULT_CONTEXTS_TOKENS",
    "DEFAULT_BLOCK_SIZES",
]

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1}

DEFAULT_CONTEXTS_TOKENS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
DEFAULT_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer with grouped-query attention and a gated (SwiGLU) MLP."""

    name: str
    num_layers: int
    hidden_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for key in (
            "num_layers",
            "hidden_size",
            "num_q_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
        ):
            value = getattr(self, key)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise InvalidArgumentError(f"ModelShape.{key} must be an integer >= 1, got {value!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise InvalidArgumentError(
                f"num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.dtype not in DTYPE_BYTES:
            raise InvalidArgumentError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def params_per_layer(self) -> int:
        """Weights touched per token per layer: q, k, v, o projections and the three MLP matrices."""
        q_dim = self.num_q_heads * self.head_dim
        kv_dim = self.num_kv_heads * self.head_dim
        return (
            self.hidden_size * (q_dim + 2 * kv_dim)
            + q_dim * self.hidden_size
            + 3 * self.hidden_size * self.intermediate_size
        )

    def linear_flops(self, context_tokens: float) -> float:
        """Multiply-adds (x2) of the projections and MLP over a prefill of ``context_tokens``."""
        return 2.0 * self.num_layers * self.params_per_layer * context_tokens

    def attention_flops(self, context_tokens: float) -> float:
        """Causal attention over the prefill: token i attends to i keys, QK^T and PV each 2*q_dim*i."""
        q_dim = self.num_q_heads * self.head_dim
        n = float(context_tokens)
        return 2.0 * self.num_layers * q_dim * n * (n + 1.0)

    def prefill_flops(self, context_tokens: float) -> float:
        return self.linear_flops(context_tokens) + self.attention_flops(context_tokens)


@dataclass(frozen=True)
class Hardware:
    """Accelerator and host link: the prefill FLOP rate achieved and the swap path's cost."""

    name: str
    prefill_flops_per_s: float
    host_link_bytes_per_s: float
    per_transfer_latency_s: float

    def __post_init__(self) -> None:
        if not (
            self.prefill_flops_per_s > 0
            and self.host_link_bytes_per_s > 0
            and self.per_transfer_latency_s >= 0
        ):
            raise InvalidArgumentError(f"hardware rates must be > 0 and latency >= 0, got {self}")


# Llama-3-8B: 32 layers, hidden 4096, 32 query heads / 8 KV heads of 128, MLP 14336, bf16
# (128 KiB of KV per token).
LLAMA3_8B = ModelShape(
    "Llama-3-8B",
    num_layers=32,
    hidden_size=4096,
    num_q_heads=32,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=14336,
    dtype="bfloat16",
)

# H200 SXM: 989 TFLOP/s dense BF16 peak; prefill reaches about half of it (50 % MFU).
# PCIe 5.0 x16: 64 GB/s per direction raw, about 50 GB/s achieved from pinned host memory.
# One cudaMemcpyAsync of a small block costs a few microseconds of launch and DMA setup.
H200_PCIE5 = Hardware(
    "H200 SXM, PCIe 5.0 x16 host link",
    prefill_flops_per_s=0.5 * 989e12,
    host_link_bytes_per_s=50e9,
    per_transfer_latency_s=5e-6,
)


@dataclass(frozen=True)
class CostModel:
    """Seconds to recompute or swap one preempted sequence (see the module docstring)."""

    model: ModelShape = LLAMA3_8B
    hardware: Hardware = H200_PCIE5

    def num_blocks(self, context_tokens: int, block_size: int) -> int:
        check_positive_counts(context_tokens=context_tokens, block_size=block_size)
        return -(-int(context_tokens) // int(block_size))

    def copies_per_block(self) -> int:
        """K and V are separate tensors per layer, so a block is one copy per layer per tensor."""
        return 2 * self.model.num_layers

    def swap_bytes(self, context_tokens: int, block_size: int) -> int:
        """Bytes moved one way: whole blocks, the partly filled last one included."""
        return self.num_blocks(context_tokens, block_size) * block_size * self.model.kv_bytes_per_token

    def recompute_s(self, context_tokens: int) -> float:
        check_positive_counts(context_tokens=context_tokens)
        return self.model.prefill_flops(context_tokens) / self.hardware.prefill_flops_per_s

    def swap_one_way_s(self, context_tokens: int, block_size: int) -> float:
        copies = self.num_blocks(context_tokens, block_size) * self.copies_per_block()
        return (
            self.swap_bytes(context_tokens, block_size) / self.hardware.host_link_bytes_per_s
            + copies * self.hardware.per_transfer_latency_s
        )

    def swap_s(self, context_tokens: int, block_size: int) -> float:
        """Swap out at preemption plus swap in at resumption."""
        return 2.0 * self.swap_one_way_s(context_tokens, block_size)

    def crossover_context_tokens(self, block_size: int, *, max_context_tokens: int = 1 << 20) -> int | None:
        """Smallest context (tokens) from which on swapping is cheaper than recomputing, or None
        when swapping stays dearer up to ``max_context_tokens``.

        Swap's cost is a staircase: constant within a block, one block's cost higher at each
        block start. Recompute's cost is convex in the context (linear plus causal attention), so
        recompute minus swap at the block starts is convex in the block count and, once swap wins
        at a block start, it wins at every later one. Bisect for that first block, then for the
        first winning token inside the block before it.
        """
        check_positive_counts(block_size=block_size)

        def swap_wins(context_tokens: int) -> bool:
            return self.swap_s(context_tokens, block_size) < self.recompute_s(context_tokens)

        def wins_at_block_start(block_count: int) -> bool:
            return swap_wins((block_count - 1) * block_size + 1)

        max_blocks = -(-max_context_tokens // block_size)
        if wins_at_block_start(1):
            first_block = 1
        else:
            losing, winning = 1, 2
            while not wins_at_block_start(winning):
                if winning >= max_blocks:
                    return None
                losing, winning = winning, min(2 * winning, max_blocks)
            first_block = _first_true(wins_at_block_start, losing, winning)
        crossover = (first_block - 1) * block_size + 1
        if first_block >= 2 and swap_wins((first_block - 1) * block_size):
            # Swap's cost is flat inside the previous block and recompute's rises: the first
            # winning token there is found by bisection.
            crossover = _first_true(swap_wins, (first_block - 2) * block_size, (first_block - 1) * block_size)
        return crossover if crossover <= max_context_tokens else None

    def table(
        self,
        contexts_tokens: Sequence[int] = DEFAULT_CONTEXTS_TOKENS,
        block_sizes: Sequence[int] = DEFAULT_BLOCK_SIZES,
    ) -> dict:
        """JSON-ready grid: recompute seconds [C] and swap seconds [B][C], plus crossovers [B]."""
        return {
            "model": asdict(self.model),
            "hardware": asdict(self.hardware),
            "contexts_tokens": list(map(int, contexts_tokens)),
            "block_sizes": list(map(int, block_sizes)),
            "recompute_s": [self.recompute_s(c) for c in contexts_tokens],
            "swap_s": [[self.swap_s(c, b) for c in contexts_tokens] for b in block_sizes],
            "crossover_context_tokens": [self.crossover_context_tokens(b) for b in block_sizes],
        }


def _first_true(predicate: Callable[[int], bool], losing: int, winning: int) -> int:
    """Smallest n in (losing, winning] with predicate(n), by bisection: predicate(losing) is
    false, predicate(winning) true, and the predicate never turns false again once true."""
    while winning - losing > 1:
        middle = (losing + winning) // 2
        if predicate(middle):
            winning = middle
        else:
            losing = middle
    return winning


def check_positive_counts(**values: int) -> None:
    for key, value in values.items():
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise InvalidArgumentError(f"{key} must be an integer >= 1, got {value!r}")
