"""The bf16-weight projection kernel (``pagedkv.models.bf16_weights``) against NumPy, and the llama
model's bf16 mode against its fp32 mode.

Tolerance: the kernel sums fp32 products in its own order, so each output is within
``4 * k * 2^-24 * sum_i |x_i w_i|`` (plus 1e-30) of the exact product of the same bf16 weights;
the check computes that product in float64. Hostile arguments raise ``InvalidArgumentError``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedkv import _core
from pagedkv.errors import InvalidArgumentError
from pagedkv.models.bf16_weights import Bf16Weights, bf16_bits_to_f32, to_bf16_bits
from pagedkv.models.llama import LlamaModel
from pagedkv.models.llama.config import LlamaConfig
from pagedkv.models.llama.file import GgufModel, LayerWeights

from cpu.dense_attention import DenseAttention


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 40), st.integers(0, 70), st.integers(0, 90), st.integers(0, 2**31))
def test_matmul_matches_float64_reference(t: int, k: int, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, k)).astype(np.float32)
    w = Bf16Weights(rng.standard_normal((k, n)).astype(np.float32))
    got = w.matmul(x)
    wide = w.to_f32().astype(np.float64)
    want = x.astype(np.float64) @ wide
    bound = 4 * max(k, 1) * 2.0**-24 * (np.abs(x.astype(np.float64)) @ np.abs(wide)) + 1e-30
    assert got.shape == (t, n) and got.dtype == np.float32
    assert np.all(np.abs(got - want) <= bound)


def test_a_row_does_not_depend_on_its_batch() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((9, 37)).astype(np.float32)
    w = Bf16Weights(rng.standard_normal((37, 150)).astype(np.float32))
    whole = w.matmul(x)
    for i in range(9):
        assert np.array_equal(w.matmul(x[i : i + 1])[0], whole[i])


def test_panels_round_trip_the_rounded_weights() -> None:
    w = np.random.default_rng(2).standard_normal((5, 70)).astype(np.float32)
    assert np.array_equal(Bf16Weights(w).to_f32(), bf16_bits_to_f32(to_bf16_bits(w)))


def test_to_bf16_bits_rounds_to_nearest_even() -> None:
    one = np.float32(1.0).view(np.uint32)
    cases = np.array(
        [one + 0x8000, one + 0x8001, one + 0x18000, 0x7F7FFFFF, 0x7F800000, 0x7FC00001],
        np.uint32,
    ).view(np.float32)
    bits = to_bf16_bits(cases)
    # 1 + half an ulp -> 1 (even); just above -> 1 + ulp; 1 + 1.5 ulp -> 1 + 2 ulp (even);
    # the largest fp32 rounds up to infinity; infinity and NaN stay.
    assert bits[:5].tolist() == [0x3F80, 0x3F81, 0x3F82, 0x7F80, 0x7F80]
    assert np.isnan(bf16_bits_to_f32(bits[5:]))[0]


_PANELS = np.zeros((1, 3, 64), np.uint16)  # n = 4 columns of a k = 3 matrix


@pytest.mark.parametrize(
    ("x", "w", "n", "match"),
    [
        (np.ones((2, 3), np.float64), _PANELS, 4, "float32"),
        (np.ones((2, 3), np.float32), _PANELS.astype(np.float32), 4, "uint16"),
        (np.ones((2, 5), np.float32), _PANELS, 4, "panels"),
        (np.ones((2, 3), np.float32), _PANELS, 65, "panels"),
        (np.ones(3, np.float32), _PANELS, 4, "2-D"),
        (np.ones((2, 3), np.float32), _PANELS[0], 4, "3-D"),
        (np.ones((2, 3), np.float32), np.zeros((1, 64, 3), np.uint16).transpose(0, 2, 1), 4, "C-contiguous"),
        ([[1.0, 2.0, 3.0]], _PANELS, 4, "float32"),
    ],
)
def test_hostile_arguments_are_refused(x: object, w: object, n: int, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        _core.cpu_matmul_bf16(x, w, n)  # type: ignore[arg-type]


def test_negative_width_and_bad_weights_are_refused() -> None:
    with pytest.raises(OverflowError):
        _core.cpu_matmul_bf16(np.ones((2, 3), np.float32), _PANELS, -1)
    with pytest.raises(InvalidArgumentError, match="2-D"):
        Bf16Weights(np.ones(3, np.float32))


def _tiny_gguf() -> GgufModel:
    """A 2-layer random llama (the shapes of tests/engine/tiny_llama.py, untied output)."""
    c = LlamaConfig(
        num_layers=2,
        d_model=32,
        d_ffn=64,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=8,
        vocab_size=64,
        max_model_len=64,
        rope_base=10000.0,
        rms_eps=1e-5,
        tied_embeddings=False,
    )
    rng = np.random.default_rng(0)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)

    layers = [
        LayerWeights(
            attn_norm=np.ones(32, np.float32),
            wq=w(32, 32) * 4,
            wk=w(32, 16) * 4,
            wv=w(32, 16),
            wo=w(32, 32),
            ffn_norm=np.ones(32, np.float32),
            w_gate=w(32, 64),
            w_up=w(32, 64),
            w_down=w(64, 32),
        )
        for _ in range(2)
    ]
    return GgufModel(
        path=Path("tiny.gguf"),
        config=c,
        metadata={},
        token_embedding=rng.standard_normal((64, 32)).astype(np.float32),
        layers=layers,
        output_norm=np.ones(32, np.float32),
        output=(rng.standard_normal((32, 64)) * 2).astype(np.float32),
        tensor_types={},
    )


def test_llama_weight_modes_are_checked() -> None:
    with pytest.raises(ValueError, match="weights"):
        LlamaModel(_tiny_gguf(), weights="int3")


def test_llama_bf16_mode_stays_close_to_fp32() -> None:
    """The tiny llama's decode logits in bf16 mode against fp32 mode: equal greedy tokens, and
    logits within 2 % of their range (bf16 weights: 2^-9 relative error per weight)."""
    model = _tiny_gguf()
    ref = LlamaModel(model, weights="fp32")
    bf = LlamaModel(model, weights="bf16")

    a, b = DenseAttention(), DenseAttention()
    token = 3
    for pos in range(12):
        la = ref.forward(np.array([token]), np.array([pos]), a)[0]
        lb = bf.forward(np.array([token]), np.array([pos]), b)[0]
        assert not np.array_equal(la, lb)  # the bf16 kernel did run
        assert np.max(np.abs(la - lb)) <= 0.02 * (la.max() - la.min())
        assert int(np.argmax(la)) == int(np.argmax(lb))
        token = int(np.argmax(la))


def test_llama_bf16_logits_do_not_depend_on_batch_size() -> None:
    """A batch larger than any decode batch (12 rows) gives each row the logits it gets alone:
    bf16 mode runs every batch size through the batch-independent kernel (the engine's promise
    that a request's tokens equal running it alone rests on this)."""
    model = LlamaModel(_tiny_gguf(), weights="bf16")

    class Rows:  # each row attends to itself only: rows are independent sequences
        def attend(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
            return np.repeat(v, q.shape[1] // v.shape[1], axis=1)

    tokens, positions = np.arange(12) % 64, np.arange(12) % 5
    whole = model.forward(tokens, positions, Rows())
    for i in range(12):
        alone = model.forward(tokens[i : i + 1], positions[i : i + 1], Rows())
        assert np.array_equal(alone[0], whole[i])
