"""Quality of the quantized KV caches on real models: perplexity and greedy agreement of
SmolLM2-135M and Gemma 3 270M over tests/data/web_exodus_1_6.txt (a public-domain text of about
5 K tokens; tests/data/README.md), every token scored by a decode step that reads the cache
(``pagedkv.benchmarks.kv_quality``), each dtype against the float16 cache.

    python benches/quant_quality.py [--models smollm2,gemma3] [--dtypes float32,float16,int8,fp8_e4m3,int4]
                                    [--tokens N] [--out results.json]

``--fallback 2,3`` also scores int8 with one-byte scales of 2 and 3 mantissa bits (E6M2-like,
E5M3-like, their exponent ranges ignored; the range of exponents used is reported), emulated:
each K/V row is quantized and dequantized in NumPy and the values stored in an fp32 cache read
by the same kernels (attention on a quantized cache is, bit for bit, attention on its
dequantized values; docs/quantized_kv.md).
``--fp8-limit`` also scores keys and values (and keys only) rounded to 3 mantissa bits with
float32's exponent range (emulated the same way): e4m3's precision without any scale or range
limit, the best any fp8 scale layout (per token, per channel) could reach.
``--split int8,fp8_e4m3`` also scores each named 8-bit dtype with only the keys quantized and
with only the values (emulated the same way, the other tensor float16): which of the two costs
the perplexity.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
from pagedkv.attention.dtypes import to_compute
from pagedkv.attention.quant_codec import dequantize_8bit, quantize_8bit
from pagedkv.benchmarks.kv_quality import TextScore, compare, score_text
from pagedkv.engine.kv_store import PagedKvStore
from pagedkv.models import load_model

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "web_exodus_1_6.txt"
MODELS = {"smollm2": None, "gemma3": "gemma3"}


SCALE_EXPONENTS: dict[int, list[float]] = {}  # mantissa bits -> [min, max] log2 of the scales used


def mantissa_scale_int8(mantissa_bits: int) -> Any:
    """int8 codes with a per-row one-byte scale of ``mantissa_bits`` mantissa bits (the smallest
    ``(1 + i / 2^mantissa_bits) * 2^e`` with ``amax <= 127 * scale``, its exponent range ignored),
    quantized and dequantized (fp32); records the range of scale exponents it used."""

    def round_trip(x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        amax = np.abs(x).max(axis=-1, keepdims=True).astype(np.float64)
        need = np.maximum(amax / 127.0, np.finfo(np.float32).tiny)
        e = np.floor(np.log2(need))
        steps = 2**mantissa_bits
        scale = np.full_like(need, np.inf)
        for i in range(steps + 1):
            cand = (1.0 + i / steps) * np.exp2(e)
            scale = np.where((cand >= need) & (cand < scale), cand, scale)
        used = np.floor(np.log2(scale[amax > 0])) if (amax > 0).any() else np.zeros(1)
        seen = SCALE_EXPONENTS.setdefault(mantissa_bits, [np.inf, -np.inf])
        seen[0], seen[1] = min(seen[0], float(used.min())), max(seen[1], float(used.max()))
        scale = scale.astype(np.float32)
        codes = np.clip(np.rint(x / scale), -127, 127)
        return (codes * scale).astype(np.float32)

    return round_trip


def mantissa3(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to 3 mantissa bits (to nearest even) with float32's exponent range: e4m3's
    precision with no scale at all, so no range limit (no subnormals, no saturation). Any scale,
    per token or per channel, can at best bring fp8 to this."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFFF) + ((u >> np.uint32(20)) & np.uint32(1))) & np.uint32(0xFFF00000)
    return rounded.view(np.float32)


def f16(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to float16 and back, as the quantized caches' attention takes it."""
    return to_compute(np.asarray(x, np.float16), "float16").astype(np.float32)


def emulated_store(key: Any, value: Any) -> type[PagedKvStore]:
    """An fp32 cache holding ``key(k)`` and ``value(v)`` of each written K/V row (each a quantize
    and dequantize round trip, or the identity); queries, keys and values rounded to float16
    first and the output after, as the quantized caches' attention takes and returns them. So
    the round trip of a real dtype scores exactly as its cache does (checked: the same negative
    log-likelihoods, bit for bit; without the output's rounding they differ)."""

    class EmulatedStore(PagedKvStore):
        def attend(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, window: int | None = None):
            return f16(super().attend(layer, f16(q), key(f16(k)), value(f16(v)), window))

    return EmulatedStore


def round_trip_8bit(kv_cache_dtype: str) -> Any:
    """The values an ``int8`` / ``fp8_e4m3`` cache stores for a row (the codec's codes times
    their UE5M3 scale)."""
    return lambda x: dequantize_8bit(*quantize_8bit(x, kv_cache_dtype), kv_cache_dtype).astype(np.float32)


def score_emulated(model: Any, ids: list[int], store: type[PagedKvStore], label: str) -> TextScore:
    import pagedkv.benchmarks.kv_quality as kvq

    original = kvq.PagedKvStore
    kvq.PagedKvStore = store  # type: ignore[misc]
    try:
        run = score_text(model, ids, "float32")
    finally:
        kvq.PagedKvStore = original  # type: ignore[misc]
    return TextScore(label, run.nll, run.greedy, run.seconds)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="smollm2,gemma3")
    parser.add_argument("--dtypes", default="float16,float32,int8,fp8_e4m3,int4")
    parser.add_argument("--tokens", type=int, default=0, help="score only the first N tokens (0: all)")
    parser.add_argument(
        "--fallback", default="", help="mantissa bits of emulated one-byte int8 scales to score (e.g. 2,3)"
    )
    parser.add_argument(
        "--fp8-limit",
        action="store_true",
        help="also score keys and values (and keys only) rounded to 3 mantissa bits with no range limit",
    )
    parser.add_argument("--split", default="", help="8-bit dtypes to score with keys only / values only")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dtypes = args.dtypes.split(",")
    if not set(filter(None, args.split.split(","))) <= {"int8", "fp8_e4m3"}:
        parser.error("--split takes int8 and/or fp8_e4m3")
    if dtypes[0] != "float16":
        dtypes = ["float16", *[d for d in dtypes if d != "float16"]]
    text = TEXT.read_text(encoding="utf-8")
    out: dict[str, Any] = {"text": TEXT.name, "models": {}}
    for name in args.models.split(","):
        model = load_model(MODELS[name])
        ids = model.tokenizer.encode(text)
        if args.tokens:
            ids = ids[: args.tokens]
        say = lambda msg, name=name: print(f"{name}: {msg}", file=sys.stderr, flush=True)  # noqa: E731
        runs = {}
        for dtype in dtypes:
            runs[dtype] = score_text(model, ids, dtype, progress=say)
            say(f"{dtype}: perplexity {runs[dtype].perplexity:.4f} ({runs[dtype].seconds:.0f} s)")
        extra = []
        for bits in [int(b) for b in filter(None, args.fallback.split(","))]:
            rt = mantissa_scale_int8(bits)
            extra.append((f"int8_m{bits}_scale", emulated_store(rt, rt)))
        if args.fp8_limit:
            extra.append(("mantissa3_kv", emulated_store(mantissa3, mantissa3)))
            extra.append(("mantissa3_keys_only", emulated_store(mantissa3, f16)))
        for dtype in filter(None, args.split.split(",")):
            extra.append((f"{dtype}_keys_only", emulated_store(round_trip_8bit(dtype), f16)))
            extra.append((f"{dtype}_values_only", emulated_store(f16, round_trip_8bit(dtype))))
        for label, store in extra:
            runs[label] = score_emulated(model, ids, store, f"{label} (emulated)")
            say(f"{label}: perplexity {runs[label].perplexity:.4f}")
        if SCALE_EXPONENTS:
            say(f"scale exponents used (mantissa bits: [min, max]): {SCALE_EXPONENTS}")
            out.setdefault("scale_exponents", {})[name] = dict(SCALE_EXPONENTS)
            SCALE_EXPONENTS.clear()
        base = runs["float16"]
        out["models"][name] = {"tokens": len(ids), "rows": {d: compare(r, base) for d, r in runs.items()}}
        for d, row in out["models"][name]["rows"].items():
            print(
                f"{name:>8} {d:>16}: perplexity {row['perplexity']:.4f} ({row['perplexity_change']:+.3%} vs "
                f"float16), greedy agreement {row['greedy_agreement']:.2%}"
            )
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
