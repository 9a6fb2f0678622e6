"""A short version of benches/quant_quality.py in the test suite: SmolLM2-135M scores the first
160 tokens of tests/data/web_exodus_1_6.txt (public domain) with every score from a decode step
reading the cache (``pagedkv.benchmarks.kv_quality``), on the float16 cache and the quantized
ones. Stated tolerances, about three times what this text measures (the full-length numbers are
in benches/results/2026-12-06-quant-quality.md): perplexity within +2 % of float16 for int8 and
fp8_e4m3, +8 % for int4; greedy agreement with float16 at least 90 % (8-bit) and 85 % (int4).
A wrong scale, a misplaced code or an unread residual costs far more than that."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

TEXT = Path(__file__).resolve().parents[1] / "data" / "web_exodus_1_6.txt"
TOKENS = 160
LIMITS = {"int8": (0.02, 0.90), "fp8_e4m3": (0.02, 0.90), "int4": (0.08, 0.85)}


@pytest.fixture(scope="module")
def scores(smollm):
    from pagedkv.benchmarks.kv_quality import score_text

    ids = smollm.tokenizer.encode(TEXT.read_text(encoding="utf-8"))[:TOKENS]
    return {d: score_text(smollm, ids, d) for d in ("float16", *LIMITS)}


@pytest.mark.parametrize("dtype", list(LIMITS))
def test_quantized_caches_stay_close_to_float16(scores, dtype):
    from pagedkv.benchmarks.kv_quality import compare

    row = compare(scores[dtype], scores["float16"])
    change, agreement = LIMITS[dtype]
    assert row["perplexity_change"] <= change, row
    assert row["greedy_agreement"] >= agreement, row
    # The cache was read: a quantized run is not the float16 run.
    assert row["perplexity_change"] != 0.0


def test_the_text_is_long_enough_for_the_benchmark(smollm):
    """The benchmark's text holds at least 4 K tokens (the issue's bound)."""
    assert len(smollm.tokenizer.encode(TEXT.read_text(encoding="utf-8"))) >= 4096


def test_the_benchmarks_emulated_caches_score_exactly_as_the_real_ones(smollm):
    """benches/quant_quality.py scores formats the caches do not have (``--fallback``,
    ``--split``) by emulation: an fp32 cache of each row's quantize-dequantize round trip, with
    the float16 roundings of the quantized caches' attention. Emulating a real dtype must give
    that dtype's own scores bit for bit, or the emulated rows are not comparable with the rest."""
    import importlib.util

    from pagedkv.benchmarks.kv_quality import score_text

    path = Path(__file__).resolve().parents[2] / "benches" / "quant_quality.py"
    spec = importlib.util.spec_from_file_location("quant_quality", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    ids = smollm.tokenizer.encode(TEXT.read_text(encoding="utf-8"))[:48]
    for dtype in ("int8", "fp8_e4m3"):
        trip = bench.round_trip_8bit(dtype)
        emulated = bench.score_emulated(smollm, ids, bench.emulated_store(trip, trip), dtype)
        real = score_text(smollm, ids, dtype)
        np.testing.assert_array_equal(emulated.nll, real.nll)
    identity = bench.score_emulated(smollm, ids, bench.emulated_store(bench.f16, bench.f16), "float16")
    np.testing.assert_array_equal(identity.nll, score_text(smollm, ids, "float16").nll)
