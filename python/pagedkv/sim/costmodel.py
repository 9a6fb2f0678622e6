"""Recompute or swap? The cost of bringing a preempted sequence back, modelled and measured.

A preempted sequence of ``context_tokens`` tokens can be brought back two ways:

* **recompute**: drop its KV cache and run the prefill over the whole context again when it is
  resumed. Cost = prefill FLOPs / FLOP rate; the FLOPs grow linearly (projections, MLP) plus
  quadratically (causal attention) with the context.
* **swap**: copy its blocks to host memory and back. Cost, for both directions,
  ``2 * (bytes / link_bandwidth + copies * per_transfer_latency)``; the KV cache is laid out per
  layer with separate K and V tensors (DESIGN.md §4), so one block is ``2 * num_layers`` copies,
  and a whole last block is moved even when partly filled.

Swap pays a latency per block, recompute does not: with tiny blocks swapping loses, with large
blocks it wins beyond some context. `CostModel.crossover_context_tokens` finds that point.

`measure_cpu` measures both for real on this CPU: recompute as an actual NumPy transformer
prefill (`NumpyTransformer`), swap as one NumPy copy per block (per layer, K and V) between a
device-pool array and a host-pool array. `fit_cpu` turns the measurements into the model's
parameters for this CPU, so the model's predictions can be checked against what was measured.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from pagedkv.errors import InvalidArgumentError

__all__ = [
    "DTYPE_BYTES",
    "ModelShape",
    "Hardware",
    "CostModel",
    "LLAMA3_8B",
    "H200_PCIE5",
    "CPU_MEASUREMENT_SHAPE",
    "DEFAULT_CONTEXTS_TOKENS",
    "DEFAULT_BLOCK_SIZES",
    "NumpyTransformer",
    "CpuMeasurement",
    "measure_cpu",
    "fit_cpu",
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


# Llama-3-8B: 32 layers, hidden 4096, 32 query heads / 8 KV heads of 128, MLP 14336, bf16 (128 KiB of KV per token).
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

# Small enough that a 16K-token prefill takes about a second on one CPU core, yet a real
# transformer: two layers, grouped-query attention (4 query heads share 1 KV head), SwiGLU.
CPU_MEASUREMENT_SHAPE = ModelShape(
    "cpu-tiny",
    num_layers=1,
    hidden_size=128,
    num_q_heads=2,
    num_kv_heads=1,
    head_dim=32,
    intermediate_size=256,
    dtype="float32",
)


@dataclass(frozen=True)
class CostModel:
    """Seconds to recompute or swap one preempted sequence (see the module docstring)."""

    model: ModelShape = LLAMA3_8B
    hardware: Hardware = H200_PCIE5

    def num_blocks(self, context_tokens: int, block_size: int) -> int:
        _check_positive(context_tokens=context_tokens, block_size=block_size)
        return -(-int(context_tokens) // int(block_size))

    def copies_per_block(self) -> int:
        """K and V are separate tensors per layer, so a block is one copy per layer per tensor."""
        return 2 * self.model.num_layers

    def swap_bytes(self, context_tokens: int, block_size: int) -> int:
        """Bytes moved one way: whole blocks, the partly filled last one included."""
        return self.num_blocks(context_tokens, block_size) * block_size * self.model.kv_bytes_per_token

    def recompute_s(self, context_tokens: int) -> float:
        _check_positive(context_tokens=context_tokens)
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
        _check_positive(block_size=block_size)

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


def _check_positive(**values: int) -> None:
    for key, value in values.items():
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise InvalidArgumentError(f"{key} must be an integer >= 1, got {value!r}")


class NumpyTransformer:
    """A real decoder-only transformer prefill in NumPy (float32): RMSNorm, rotary embeddings,
    grouped-query causal attention (chunked over queries, so a 16K context needs no 16K x 16K
    matrix), SwiGLU MLP, residuals. Weights are random: the arithmetic, not the text, is measured.
    """

    def __init__(
        self,
        shape: ModelShape = CPU_MEASUREMENT_SHAPE,
        *,
        seed: int = 0,
        vocab_size: int = 1024,
        query_chunk_tokens: int = 512,
    ) -> None:
        self.shape = shape
        self.query_chunk_tokens = query_chunk_tokens
        rng = np.random.default_rng(seed)
        hidden = shape.hidden_size
        q_dim = shape.num_q_heads * shape.head_dim
        kv_dim = shape.num_kv_heads * shape.head_dim

        def weight(rows: int, cols: int) -> np.ndarray:
            return (rng.standard_normal((rows, cols)) / np.sqrt(rows)).astype(np.float32)

        self.embedding = weight(vocab_size, hidden)  # [vocab, hidden]
        self.layers = [
            {
                "wqkv": weight(hidden, q_dim + 2 * kv_dim),  # [hidden, q_dim + 2 kv_dim]
                "wo": weight(q_dim, hidden),  # [q_dim, hidden]
                "w_gate_up": weight(hidden, 2 * shape.intermediate_size),  # [hidden, 2 I]
                "w_down": weight(shape.intermediate_size, hidden),  # [I, hidden]
            }
            for _ in range(shape.num_layers)
        ]

    @staticmethod
    def _rms_norm(x: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)

    def _rotary(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """x [n, heads, head_dim] rotated by position (half-split rotary embedding)."""
        half = self.shape.head_dim // 2
        inv_freq = 1.0 / (10000.0 ** (np.arange(half, dtype=np.float32) / half))
        angles = positions[:, None].astype(np.float32) * inv_freq[None, :]  # [n, half]
        cos = np.cos(angles)[:, None, :]
        sin = np.sin(angles)[:, None, :]
        first, second = x[..., :half], x[..., half : 2 * half]
        rotated = np.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)
        if self.shape.head_dim % 2:
            rotated = np.concatenate([rotated, x[..., -1:]], axis=-1)
        return rotated

    def causal_attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """q [n, q_heads, d], k/v [n, kv_heads, d] -> [n, q_heads, d]; query i sees keys 0..i."""
        n, num_q_heads, head_dim = q.shape
        group = num_q_heads // k.shape[1]
        scale = np.float32(1.0 / np.sqrt(head_dim))
        out = np.empty_like(q)
        chunk = self.query_chunk_tokens
        for kv_head in range(k.shape[1]):
            keys = k[:, kv_head, :]  # [n, d]
            values = v[:, kv_head, :]  # [n, d]
            heads = slice(kv_head * group, (kv_head + 1) * group)
            for start in range(0, n, chunk):
                stop = min(n, start + chunk)
                queries = q[start:stop, heads, :].reshape(-1, head_dim)  # [(stop-start) * group, d]
                scores = (queries @ keys[:stop].T) * scale  # [(stop-start) * group, stop]
                query_pos = np.repeat(np.arange(start, stop), group)[:, None]
                scores[np.arange(stop)[None, :] > query_pos] = -np.inf
                scores -= scores.max(axis=1, keepdims=True)
                np.exp(scores, out=scores)
                scores /= scores.sum(axis=1, keepdims=True)
                out[start:stop, heads, :] = (scores @ values[:stop]).reshape(stop - start, group, head_dim)
        return out

    def prefill(self, token_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """token_ids int [n] -> (k_cache, v_cache [num_layers, n, kv_heads, d], last hidden [hidden])."""
        shape = self.shape
        n = int(token_ids.shape[0])
        q_dim = shape.num_q_heads * shape.head_dim
        kv_dim = shape.num_kv_heads * shape.head_dim
        positions = np.arange(n)
        k_cache = np.empty((shape.num_layers, n, shape.num_kv_heads, shape.head_dim), dtype=np.float32)
        v_cache = np.empty_like(k_cache)
        x = self.embedding[token_ids % self.embedding.shape[0]]  # [n, hidden]
        for index, layer in enumerate(self.layers):
            qkv = self._rms_norm(x) @ layer["wqkv"]
            q = self._rotary(qkv[:, :q_dim].reshape(n, shape.num_q_heads, shape.head_dim), positions)
            k = self._rotary(
                qkv[:, q_dim : q_dim + kv_dim].reshape(n, shape.num_kv_heads, shape.head_dim), positions
            )
            v = qkv[:, q_dim + kv_dim :].reshape(n, shape.num_kv_heads, shape.head_dim)
            k_cache[index] = k
            v_cache[index] = v
            x = x + self.causal_attention(q, k, v).reshape(n, q_dim) @ layer["wo"]
            gate_up = self._rms_norm(x) @ layer["w_gate_up"]
            gate, up = gate_up[:, : shape.intermediate_size], gate_up[:, shape.intermediate_size :]
            x = x + ((gate / (1.0 + np.exp(-gate))) * up) @ layer["w_down"]
        return k_cache, v_cache, x[-1]


def _best_time_s(run: Callable[[], object], *, min_repeats: int = 3, max_single_s: float = 0.25) -> float:
    """Fastest of ``min_repeats`` runs after one warm-up (a single run once it is slow anyway):
    the minimum is the least disturbed by other processes on a shared machine."""
    start_s = time.perf_counter()
    run()
    best_s = time.perf_counter() - start_s
    if best_s > max_single_s:
        return best_s
    for _ in range(min_repeats):
        start_s = time.perf_counter()
        run()
        best_s = min(best_s, time.perf_counter() - start_s)
    return best_s


def _swap_copies(
    device_k: list[np.ndarray],
    device_v: list[np.ndarray],
    host_k: list[np.ndarray],
    host_v: list[np.ndarray],
    device_blocks: np.ndarray,
    host_blocks: np.ndarray,
    to_host: bool,
) -> None:
    """One NumPy copy per block per layer per tensor, as a swap kernel without run merging does.

    Pools are [num_blocks, block_size, kv_heads, head_dim]; block id arrays are int [N].
    """
    pairs = list(zip(device_blocks.tolist(), host_blocks.tolist()))
    for layer in range(len(device_k)):
        for device_pool, host_pool in ((device_k[layer], host_k[layer]), (device_v[layer], host_v[layer])):
            if to_host:
                for device_block, host_block in pairs:
                    host_pool[host_block] = device_pool[device_block]
            else:
                for device_block, host_block in pairs:
                    device_pool[device_block] = host_pool[host_block]


@dataclass
class CpuMeasurement:
    """Measured seconds on this CPU: recompute [C] and swap out + in [B][C]."""

    shape: ModelShape
    contexts_tokens: list[int]
    block_sizes: list[int]
    recompute_s: list[float]
    swap_s: list[list[float]]
    fitted: dict = field(default_factory=dict)

    def crossover_context_tokens(self) -> list[int | None]:
        """Per block size: the smallest measured context where swapping was faster, or None."""
        crossovers: list[int | None] = []
        for row in self.swap_s:
            winners = [
                c
                for c, swap_s, recompute_s in zip(self.contexts_tokens, row, self.recompute_s)
                if swap_s < recompute_s
            ]
            crossovers.append(winners[0] if winners else None)
        return crossovers

    def to_dict(self) -> dict:
        return {
            "shape": asdict(self.shape),
            "contexts_tokens": self.contexts_tokens,
            "block_sizes": self.block_sizes,
            "recompute_s": self.recompute_s,
            "swap_s": self.swap_s,
            "crossover_context_tokens": self.crossover_context_tokens(),
            "fitted": self.fitted,
        }


def measure_cpu(
    contexts_tokens: Sequence[int] = DEFAULT_CONTEXTS_TOKENS,
    block_sizes: Sequence[int] = DEFAULT_BLOCK_SIZES,
    *,
    shape: ModelShape = CPU_MEASUREMENT_SHAPE,
    seed: int = 0,
    on_step: Callable[[str], None] | None = None,
) -> CpuMeasurement:
    """Measure recompute (a real prefill) and swap (per-block copies) on this CPU.

    The device and host pools each hold ``2 * max(context)`` token slots per block size; the
    sequence's blocks are scattered over the pool (a random permutation), as in a long-running
    server, and are swapped out to other scattered host blocks and back in to new device blocks.
    ``on_step(label)`` is called after each measurement (progress reporting).
    """
    if shape.dtype != "float32":
        raise InvalidArgumentError(f"the CPU measurement runs in float32, got a {shape.dtype} shape")
    for context in contexts_tokens:
        _check_positive(context_tokens=context)
    for block_size in block_sizes:
        _check_positive(block_size=block_size)
    rng = np.random.default_rng(seed)
    transformer = NumpyTransformer(shape, seed=seed)
    recompute_s: list[float] = []
    for context in contexts_tokens:
        token_ids = rng.integers(0, 1024, size=int(context))
        recompute_s.append(_best_time_s(lambda: transformer.prefill(token_ids)))
        if on_step:
            on_step(f"prefill {context}")
    swap_s: list[list[float]] = []
    for block_size in block_sizes:
        pool_blocks = 2 * (-(-max(contexts_tokens) // block_size))
        pool_shape = (pool_blocks, block_size, shape.num_kv_heads, shape.head_dim)
        device_k = [rng.standard_normal(pool_shape).astype(np.float32) for _ in range(shape.num_layers)]
        device_v = [rng.standard_normal(pool_shape).astype(np.float32) for _ in range(shape.num_layers)]
        host_k = [np.zeros(pool_shape, dtype=np.float32) for _ in range(shape.num_layers)]
        host_v = [np.zeros(pool_shape, dtype=np.float32) for _ in range(shape.num_layers)]
        row: list[float] = []
        for context in contexts_tokens:
            num_blocks = -(-int(context) // block_size)
            device_out = rng.permutation(pool_blocks)[:num_blocks]
            host_blocks = rng.permutation(pool_blocks)[:num_blocks]
            device_back = rng.permutation(pool_blocks)[:num_blocks]

            def round_trip() -> None:
                _swap_copies(device_k, device_v, host_k, host_v, device_out, host_blocks, to_host=True)
                _swap_copies(device_k, device_v, host_k, host_v, device_back, host_blocks, to_host=False)

            row.append(_best_time_s(round_trip))
            if on_step:
                on_step(f"swap bs={block_size} ctx={context}")
        swap_s.append(row)
    measurement = CpuMeasurement(
        shape, list(map(int, contexts_tokens)), list(map(int, block_sizes)), recompute_s, swap_s
    )
    measurement.fitted = fit_cpu(measurement)
    return measurement


def _positive_least_squares(design: np.ndarray, measured: np.ndarray) -> np.ndarray:
    """Coefficients c >= 0 minimising sum((design @ c / measured - 1)^2): relative errors, so that
    the small contexts count as much as the large ones. A column whose best coefficient would be
    negative (noise) is dropped, trying every subset of the (two) columns."""
    weighted = design / measured[:, None]
    ones = np.ones_like(measured)
    best: tuple[float, np.ndarray] | None = None
    columns = design.shape[1]
    for mask in range(1, 1 << columns):
        chosen = [index for index in range(columns) if mask >> index & 1]
        solution, *_ = np.linalg.lstsq(weighted[:, chosen], ones, rcond=None)
        if np.any(solution <= 0):
            continue
        coefficients = np.zeros(columns)
        coefficients[chosen] = solution
        residual = float(np.sum((weighted @ coefficients - 1.0) ** 2))
        if best is None or residual < best[0]:
            best = (residual, coefficients)
    if best is None:
        raise InvalidArgumentError("the measurements cannot be fitted with positive rates")
    return best[1]


def fit_cpu(measurement: CpuMeasurement) -> dict:
    """This CPU's cost-model parameters, fitted to the measurements by least squares.

    Recompute: seconds = linear_flops / linear_rate + attention_flops / attention_rate (two rates:
    BLAS matmuls and the chunked softmax attention run at different speeds). Swap:
    seconds = 2 * (bytes / bandwidth + copies * latency). Returns the fitted rates (inf where a
    term was too small to measure) and the worst relative error of each fit.
    """
    model = CostModel(measurement.shape, H200_PCIE5)
    recompute = np.asarray(measurement.recompute_s, dtype=np.float64)
    design = np.array(
        [
            [measurement.shape.linear_flops(c), measurement.shape.attention_flops(c)]
            for c in measurement.contexts_tokens
        ],
        dtype=np.float64,
    )
    inverse_rates = _positive_least_squares(design, recompute)
    predicted_recompute = design @ inverse_rates

    rows = []
    measured_swap = []
    for block_size, swap_row in zip(measurement.block_sizes, measurement.swap_s):
        for context, seconds in zip(measurement.contexts_tokens, swap_row):
            copies = model.num_blocks(context, block_size) * model.copies_per_block()
            rows.append([2.0 * model.swap_bytes(context, block_size), 2.0 * copies])
            measured_swap.append(seconds)
    swap_design = np.asarray(rows, dtype=np.float64)
    measured = np.asarray(measured_swap, dtype=np.float64)
    swap_params = _positive_least_squares(swap_design, measured)
    predicted_swap = swap_design @ swap_params

    def rate(inverse: float) -> float:
        return float(1.0 / inverse) if inverse > 0 else math.inf

    return {
        "linear_flops_per_s": rate(inverse_rates[0]),
        "attention_flops_per_s": rate(inverse_rates[1]),
        "copy_bytes_per_s": rate(swap_params[0]),
        "per_copy_latency_s": float(swap_params[1]),
        "recompute_max_rel_error": float(np.max(np.abs(predicted_recompute / recompute - 1.0))),
        "swap_max_rel_error": float(np.max(np.abs(predicted_swap / measured - 1.0))),
    }
