"""How much each quantized KV format perturbs attention on a real model's keys and values.

Runs SmolLM2-135M (the engine's default model) over a prefix of docs/design.md, keeps every
layer's rotated queries, keys and values, and for each format quantizes the keys and values in
blocks of ``--block-size`` tokens with the formats' own codec (``pagedkv.attention.quant_codec``,
bit-identical to the kernels; int4 blocks from their tokens' int8 values, as a sealed block holds
them, docs/quantized_kv.md "The residual in a paged cache"), dequantizes them and measures the
causal attention output's relative error ``||out_q - out|| / ||out||`` per layer (float64
attention, so only the cache's error shows). Reference formats sit beside ours, computed here and
not shipped: int8 with an exact fp32 scale per (token, head) (vLLM's int8_per_token_head), and
KIVI's own int4 with fp16 scale and minimum per group (keys per channel over the block, values per
token). They are what the one-byte UE5M3 scales and the one-byte int4 metadata give up, measured;
so is int4 sealed from the unquantized tokens (``ref:int4-from-16-bit``, what the int8 residual
gives up). docs/quantized_kv.md uses the numbers for its format decision.

    python benches/quant_formats.py --tokens 512 --out benches/results/2026-12-06-quant-formats.json

The error is a property of the format and the data, not of the machine.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from pagedkv.attention.kv_cache_dtype import block_layout
from pagedkv.attention.quant_codec import decode_blocks, encode_blocks, round_trip_8bit

REPO = Path(__file__).resolve().parent.parent


class _Capture:
    """A KvAttention that keeps each layer's q, k, v and attends causally over the prompt."""

    def __init__(self) -> None:
        self.layers: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def attend(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        self.layers[layer] = (q.copy(), k.copy(), v.copy())
        return attention(q, k, v).astype(np.float32)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Causal softmax attention in float64: q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
    t, num_q, dim = q.shape
    num_kv = k.shape[1]
    qg = q.astype(np.float64).reshape(t, num_kv, num_q // num_kv, dim)
    s = np.einsum("tngd,snd->ngts", qg, k.astype(np.float64)) / np.sqrt(dim)
    s = np.where(np.triu(np.ones((t, t), bool), 1), -np.inf, s)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("ngts,snd->tngd", p, v.astype(np.float64)).reshape(t, num_q, dim)


def _blocks(x: np.ndarray, block_size: int) -> np.ndarray:
    return x.reshape(-1, block_size, *x.shape[1:]).astype(np.float32)


def ours(x: np.ndarray, dtype: str, role: str, block_size: int, *, via_int8: bool = True) -> np.ndarray:
    """The values a ``dtype`` cache holds for ``x``; int4 (``via_int8``) seals its tokens' int8
    residual values, as the cache does."""
    layout = block_layout(dtype, role, block_size, x.shape[1], x.shape[2])
    blocks = _blocks(x, block_size)
    if dtype == "int4" and via_int8:
        blocks = round_trip_8bit(blocks, "int8")
    return decode_blocks(encode_blocks(blocks, layout), layout).reshape(x.shape)


def int8_exact_scale(x: np.ndarray, role: str, block_size: int) -> np.ndarray:
    a = np.abs(x).max(-1, keepdims=True)
    s = np.where(a > 0, a / 127, 1)
    return np.clip(np.rint(x / s), -127, 127) * s


def kivi_fp16(x: np.ndarray, role: str, block_size: int) -> np.ndarray:
    """KIVI's asymmetric int4, fp16 scale and minimum per group (keys: per channel over the block's
    tokens; values: per token over the channels)."""
    b = _blocks(x, block_size)
    axis = 1 if role == "key" else 3
    mn = b.min(axis, keepdims=True).astype(np.float16).astype(np.float32)
    s = ((b.max(axis, keepdims=True) - mn) / 15).astype(np.float16).astype(np.float32)
    s = np.where(s == 0, 1, s)
    return (np.clip(np.rint((b - mn) / s), 0, 15) * s + mn).reshape(x.shape)


def int8_ue6m2_scale(x: np.ndarray, role: str, block_size: int) -> np.ndarray:
    """int8 with a one-byte scale of 2 mantissa bits (unsigned E6M2-like, range ignored), rounded up."""
    a = np.abs(x).max(-1, keepdims=True).astype(np.float64)
    s = np.where(a > 0, a / 127, 1)
    e = np.floor(np.log2(s))
    s = np.ceil(s / 2**e * 4) / 4 * 2**e
    return np.clip(np.rint(x / s), -127, 127) * s


def int4_per_token(x: np.ndarray, role: str, block_size: int) -> np.ndarray:
    """int4 asymmetric per token (fp16 scale and minimum) for keys and values alike: the
    baseline KIVI improves on for keys."""
    mn = x.min(-1, keepdims=True).astype(np.float16).astype(np.float32)
    s = ((x.max(-1, keepdims=True) - mn) / 15).astype(np.float16).astype(np.float32)
    s = np.where(s == 0, 1, s)
    return np.clip(np.rint((x - mn) / s), 0, 15) * s + mn


FORMATS = {
    "int8": lambda x, role, bs: ours(x, "int8", role, bs),
    "fp8_e4m3": lambda x, role, bs: ours(x, "fp8_e4m3", role, bs),
    "int4": lambda x, role, bs: ours(x, "int4", role, bs),
    "ref:int8-fp32-scale": int8_exact_scale,
    "ref:int8-ue6m2-scale": int8_ue6m2_scale,
    "ref:int4-from-16-bit": lambda x, role, bs: ours(x, "int4", role, bs, via_int8=False),
    "ref:kivi-int4-fp16-meta": kivi_fp16,
    "ref:int4-per-token-fp16-meta": int4_per_token,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layer-step", type=int, default=3, help="every n-th layer (from layer 1)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from pagedkv.models import load_model

    model = load_model()
    text = (REPO / "docs" / "design.md").read_text()
    ids = np.asarray(model.tokenizer.encode(text), np.int64)[: args.tokens]
    ids = ids[: len(ids) // args.block_size * args.block_size]
    capture = _Capture()
    start = time.perf_counter()
    model.model.forward(ids, np.arange(len(ids)), capture, logit_rows=np.array([len(ids) - 1]))
    forward_s = time.perf_counter() - start
    layers = list(range(1, len(capture.layers), args.layer_step))
    errors: dict[str, dict[str, list[float]]] = {name: {"kv": [], "k": [], "v": []} for name in FORMATS}
    for layer in layers:
        q, k, v = capture.layers[layer]
        ref = attention(q, k, v)
        norm = float(np.linalg.norm(ref))
        for name, fmt in FORMATS.items():
            kq, vq = fmt(k, "key", args.block_size), fmt(v, "value", args.block_size)
            for part, (kk, vv) in (("kv", (kq, vq)), ("k", (kq, v)), ("v", (k, vq))):
                errors[name][part].append(float(np.linalg.norm(attention(q, kk, vv) - ref)) / norm)
    result = {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF)",
        "text": f"docs/design.md, first {len(ids)} tokens",
        "block_size": args.block_size,
        "layers": layers,
        "forward_s": round(forward_s, 1),
        "relative_error_mean": {
            name: {part: round(float(np.mean(e)), 5) for part, e in parts.items()}
            for name, parts in errors.items()
        },
        "relative_error_max": {
            name: {part: round(float(np.max(e)), 5) for part, e in parts.items()}
            for name, parts in errors.items()
        },
    }
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
