"""Recompute-vs-swap cost model: formulas by hand, the crossover against brute force."""

import pytest
from pagedkv.errors import InvalidArgumentError
from pagedkv.sim import costmodel
from pagedkv.sim.costmodel import CostModel, Hardware, ModelShape

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
