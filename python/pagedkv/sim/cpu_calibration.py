"""Calibrate the recompute-or-swap cost model on this CPU: measure both for real, then fit.

`measure_cpu` measures recompute as an actual NumPy transformer prefill (`NumpyTransformer`) and
swap as one NumPy copy per block (per layer, K and V) between a device-pool array and a host-pool
array. `fit_cpu` turns the measurements into `pagedkv.sim.costmodel.CostModel` parameters for this
CPU, so the model's predictions can be checked against what was measured.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from pagedkv.errors import InvalidArgumentError
from pagedkv.sim.costmodel import (
    DEFAULT_BLOCK_SIZES,
    DEFAULT_CONTEXTS_TOKENS,
    H200_PCIE5,
    CostModel,
    ModelShape,
    check_positive_counts,
)

__all__ = ["CPU_MEASUREMENT_SHAPE", "NumpyTransformer", "CpuMeasurement", "measure_cpu", "fit_cpu"]

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
    pairs = list(zip(device_blocks.tolist(), host_blocks.tolist(), strict=True))
    for layer in range(len(device_k)):
        for device_pool, host_pool in ((device_k[layer], host_k[layer]), (device_v[layer], host_v[layer])):
            if to_host:
                for device_block, host_block in pairs:
                    host_pool[host_block] = device_pool[device_block]
            else:
                for device_block, host_block in pairs:
                    device_pool[device_block] = host_pool[host_block]


def _swap_round_trip(
    device_k: list[np.ndarray],
    device_v: list[np.ndarray],
    host_k: list[np.ndarray],
    host_v: list[np.ndarray],
    device_out: np.ndarray,
    host_blocks: np.ndarray,
    device_back: np.ndarray,
) -> None:
    """Swap out ``device_out`` to ``host_blocks``, then back in to ``device_back``."""
    _swap_copies(device_k, device_v, host_k, host_v, device_out, host_blocks, to_host=True)
    _swap_copies(device_k, device_v, host_k, host_v, device_back, host_blocks, to_host=False)


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
                for c, swap_s, recompute_s in zip(self.contexts_tokens, row, self.recompute_s, strict=True)
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
        check_positive_counts(context_tokens=context)
    for block_size in block_sizes:
        check_positive_counts(block_size=block_size)
    rng = np.random.default_rng(seed)
    transformer = NumpyTransformer(shape, seed=seed)
    recompute_s: list[float] = []
    for context in contexts_tokens:
        token_ids = rng.integers(0, 1024, size=int(context))
        recompute_s.append(_best_time_s(functools.partial(transformer.prefill, token_ids)))
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
            round_trip = functools.partial(
                _swap_round_trip, device_k, device_v, host_k, host_v, device_out, host_blocks, device_back
            )
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
    for block_size, swap_row in zip(measurement.block_sizes, measurement.swap_s, strict=True):
        for context, seconds in zip(measurement.contexts_tokens, swap_row, strict=True):
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
