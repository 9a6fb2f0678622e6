"""CPU calibration of the cost model: the real NumPy prefill and block copies it times, and a
small measurement with its fit."""

import math

import numpy as np
import pytest
from pagedkv.errors import InvalidArgumentError
from pagedkv.sim import costmodel, cpu_calibration
from pagedkv.sim.costmodel import ModelShape
from pagedkv.sim.cpu_calibration import NumpyTransformer


def _naive_attention(q, k, v):
    n, num_q_heads, head_dim = q.shape
    group = num_q_heads // k.shape[1]
    out = np.zeros_like(q)
    for i in range(n):
        for h in range(num_q_heads):
            scores = k[: i + 1, h // group, :] @ q[i, h] / math.sqrt(head_dim)
            weights = np.exp(scores - scores.max())
            out[i, h] = (weights / weights.sum()) @ v[: i + 1, h // group, :]
    return out


def test_chunked_causal_attention_equals_naive():
    rng = np.random.default_rng(0)
    transformer = NumpyTransformer(cpu_calibration.CPU_MEASUREMENT_SHAPE, query_chunk_tokens=7)
    q = rng.standard_normal((23, 4, 8)).astype(np.float32)
    k = rng.standard_normal((23, 2, 8)).astype(np.float32)
    v = rng.standard_normal((23, 2, 8)).astype(np.float32)
    np.testing.assert_allclose(
        transformer.causal_attention(q, k, v), _naive_attention(q, k, v), rtol=1e-4, atol=1e-5
    )


def test_prefill_is_causal_so_recompute_rebuilds_the_same_cache():
    shape = ModelShape(
        "t",
        num_layers=2,
        hidden_size=32,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=48,
        dtype="float32",
    )
    transformer = NumpyTransformer(shape, query_chunk_tokens=16)
    tokens = np.random.default_rng(1).integers(0, 1024, size=50)
    k_full, v_full, _ = transformer.prefill(tokens)
    k_prefix, v_prefix, _ = transformer.prefill(tokens[:37])
    assert k_full.shape == (2, 50, 2, 8)
    np.testing.assert_allclose(k_full[:, :37], k_prefix, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(v_full[:, :37], v_prefix, rtol=1e-5, atol=1e-5)
    changed = tokens.copy()
    changed[0] += 1
    assert not np.allclose(transformer.prefill(changed)[0][1, 5:], k_full[1, 5:])


def test_swap_copies_round_trip_moves_the_blocks():
    rng = np.random.default_rng(2)
    shape = (10, 4, 1, 2)
    device_k = [rng.standard_normal(shape).astype(np.float32) for _ in range(2)]
    device_v = [rng.standard_normal(shape).astype(np.float32) for _ in range(2)]
    original_k = [array.copy() for array in device_k]
    host_k = [np.zeros(shape, np.float32) for _ in range(2)]
    host_v = [np.zeros(shape, np.float32) for _ in range(2)]
    out_blocks, host_blocks, back_blocks = np.array([3, 7]), np.array([0, 9]), np.array([1, 2])
    cpu_calibration._swap_copies(device_k, device_v, host_k, host_v, out_blocks, host_blocks, to_host=True)
    cpu_calibration._swap_copies(device_k, device_v, host_k, host_v, back_blocks, host_blocks, to_host=False)
    for layer in range(2):
        np.testing.assert_array_equal(device_k[layer][back_blocks], original_k[layer][out_blocks])
        np.testing.assert_array_equal(host_v[layer][host_blocks], device_v[layer][out_blocks])


def test_cpu_measurement_small_grid():
    steps = []
    measurement = cpu_calibration.measure_cpu((16, 64), (1, 8), on_step=steps.append)
    assert len(steps) == 2 + 2 * 2
    assert len(measurement.recompute_s) == 2 and all(t > 0 for t in measurement.recompute_s)
    assert [len(row) for row in measurement.swap_s] == [2, 2]
    assert set(measurement.fitted) >= {"linear_flops_per_s", "copy_bytes_per_s", "per_copy_latency_s"}
    assert len(measurement.to_dict()["crossover_context_tokens"]) == 2
    with pytest.raises(InvalidArgumentError):
        cpu_calibration.measure_cpu((16,), (1,), shape=costmodel.LLAMA3_8B)
