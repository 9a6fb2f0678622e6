"""Recompute-vs-swap cost model: formulas by hand, the crossover against brute force, and the real
NumPy prefill and block copies that the CPU measurement times."""

import math

import numpy as np
import pytest
from pagedkv.errors import InvalidArgumentError
from pagedkv.sim import costmodel
from pagedkv.sim.costmodel import CostModel, Hardware, ModelShape, NumpyTransformer

TINY = ModelShape(
    "t",
    num_layers=2,
    hidden_size=8,
    num_q_heads=4,
    num_kv_heads=2,
    head_dim=4,
    intermediate_size=16,
    dtype="float16",
)


def test_llama3_8b_shape():
    shape = costmodel.LLAMA3_8B
    assert shape.kv_bytes_per_token == 128 * 1024
    assert shape.num_layers * shape.params_per_layer == pytest.approx(6.98e9, rel=1e-3)


def test_flops_by_hand():
    # per layer: qkv 8*(16+8+8)=256, o 16*8=128, mlp 3*8*16=384 -> 768 weights
    assert TINY.params_per_layer == 768
    assert TINY.linear_flops(10) == 2 * 2 * 768 * 10
    assert TINY.attention_flops(10) == 2 * 2 * 16 * 10 * 11
    assert TINY.kv_bytes_per_token == 2 * 2 * 2 * 4 * 2


def test_swap_and_recompute_by_hand():
    model = CostModel(
        TINY, Hardware("h", prefill_flops_per_s=1e6, host_link_bytes_per_s=1e3, per_transfer_latency_s=1e-3)
    )
    # 10 tokens in blocks of 4: 3 blocks, 12 slots of 64 bytes each, 3 * 4 copies.
    assert model.swap_bytes(10, 4) == 12 * 64
    assert model.swap_one_way_s(10, 4) == pytest.approx(12 * 64 / 1e3 + 12 * 1e-3)
    assert model.swap_s(10, 4) == pytest.approx(2 * model.swap_one_way_s(10, 4))
    assert model.recompute_s(10) == pytest.approx(TINY.prefill_flops(10) / 1e6)


def _brute_force_crossover(model, block_size, max_context):
    swap_wins = [model.swap_s(c, block_size) < model.recompute_s(c) for c in range(1, max_context + 1)]
    if not swap_wins[-1]:
        return None
    first = max_context
    while first > 1 and swap_wins[first - 2]:
        first -= 1
    return first


@pytest.mark.parametrize("latency_s", [0.0, 2e-5, 1e-4, 5e-4])
@pytest.mark.parametrize("block_size", [1, 3, 16, 64])
def test_crossover_matches_brute_force(latency_s, block_size):
    hardware = Hardware(
        "h", prefill_flops_per_s=2e9, host_link_bytes_per_s=4e5, per_transfer_latency_s=latency_s
    )
    model = CostModel(TINY, hardware)
    max_context = 3000
    expected = _brute_force_crossover(model, block_size, max_context)
    assert model.crossover_context_tokens(block_size, max_context_tokens=max_context) == expected


def test_h200_crossover_falls_with_block_size_until_blocks_get_huge():
    model = CostModel()
    crossovers = {b: model.crossover_context_tokens(b) for b in (1, 16, 32, 128)}
    assert crossovers[1] is None  # a copy per token per layer never pays off
    assert crossovers[16] > 16384 > crossovers[32] > crossovers[128]


def test_table_shapes():
    table = CostModel().table((128, 1024), (1, 16, 256))
    assert len(table["recompute_s"]) == 2 and len(table["swap_s"]) == 3 and len(table["swap_s"][0]) == 2
    assert len(table["crossover_context_tokens"]) == 3


@pytest.mark.parametrize("kwargs", [dict(num_layers=0), dict(num_q_heads=3), dict(dtype="int4")])
def test_bad_shapes_are_typed_errors(kwargs):
    base = dict(
        name="x", num_layers=1, hidden_size=8, num_q_heads=2, num_kv_heads=2, head_dim=4, intermediate_size=8
    )
    with pytest.raises(InvalidArgumentError):
        ModelShape(**{**base, **kwargs})
    with pytest.raises(InvalidArgumentError):
        CostModel().swap_s(0, 16)
    with pytest.raises(InvalidArgumentError):
        Hardware("h", 0.0, 1.0, 0.0)


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
    transformer = NumpyTransformer(costmodel.CPU_MEASUREMENT_SHAPE, query_chunk_tokens=7)
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
    costmodel._swap_copies(device_k, device_v, host_k, host_v, out_blocks, host_blocks, to_host=True)
    costmodel._swap_copies(device_k, device_v, host_k, host_v, back_blocks, host_blocks, to_host=False)
    for layer in range(2):
        np.testing.assert_array_equal(device_k[layer][back_blocks], original_k[layer][out_blocks])
        np.testing.assert_array_equal(host_v[layer][host_blocks], device_v[layer][out_blocks])


def test_cpu_measurement_small_grid():
    steps = []
    measurement = costmodel.measure_cpu((16, 64), (1, 8), on_step=steps.append)
    assert len(steps) == 2 + 2 * 2
    assert len(measurement.recompute_s) == 2 and all(t > 0 for t in measurement.recompute_s)
    assert [len(row) for row in measurement.swap_s] == [2, 2]
    assert set(measurement.fitted) >= {"linear_flops_per_s", "copy_bytes_per_s", "per_copy_latency_s"}
    assert len(measurement.to_dict()["crossover_context_tokens"]) == 2
    with pytest.raises(InvalidArgumentError):
        costmodel.measure_cpu((16,), (1,), shape=costmodel.LLAMA3_8B)
