"""The decode comparison of ``pagedkv bench-engine --sections decode``: one process, several runs.

Each run measures, back to back (the order alternating between runs):

1. pagedkv's aggregate decode tokens/s at batch 1 / 8 / 32 (16-token prompts, greedy, the
   default data plane), timed over decode steps only (the prefills run first);
2. llama.cpp's single stream on the same GGUF file (llama-cpp-python's ``Llama.generate``,
   greedy, 64 tokens) and
3. llama.cpp's batched decode through its batch API at the same batch sizes (one sequence per
   ``seq_id``, each with its own prompt and KV, one token per sequence per ``llama_decode``: how
   llama.cpp's ``examples/batched`` and server decode), timed like pagedkv's,

both with 1 thread and with the engine's thread count (on a busy machine llama.cpp's spinning
threads collapse at 2: each ratio uses its faster setting in that run), when ``llama_cpp``
imports in the interpreter ``PAGEDKV_LLAMA_PYTHON`` names (``llama_cpp_baseline``); skipped with a
note otherwise. ``decode_report`` takes the ratios within each run and their medians over the runs.
Once, after the runs: the CPU paged decode attention kernel's bytes/s of K/V read (batch 32, 2 K
context, 8 query / 2 KV heads of 64, fp32) beside ``np.copyto`` of the same bytes.

pagedkv's default weight mode (``int8``) reads the file's codes (4-bit ones packed two per
byte) with an fp32 scale and offset per block and quantizes activations to 8 bits, as llama.cpp
does with the file's blocks themselves: at batch 1 pagedkv streams ~1.2x llama.cpp's weight bytes
(0.75 against 0.625 bytes per Q4_1 weight: fp32 scales and offsets where the file has fp16).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from pagedkv.attention import paged_attention
from pagedkv.benchmarks.decode_report import print_decode_comparison, summarize_runs
from pagedkv.benchmarks.llama_cpp_baseline import engine_threads, llama_cpp_batch_api, llama_cpp_single_stream
from pagedkv.engine.llm_engine import EngineConfig, LLMEngine
from pagedkv.engine.params import SamplingParams
from pagedkv.models import LoadedModel

__all__ = ["best_of", "decode_comparison", "drive_decode", "kernel_vs_copy", "print_decode_comparison"]

PROMPT_TOKENS = 16  # each request's prompt, pagedkv's and llama.cpp's batched
DECODE_TOKENS = 16  # timed decode steps after the prefill's first token, pagedkv's and llama.cpp's batched


def best_of(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` timed calls, in seconds."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def kernel_vs_copy(
    dtype: Any = np.float32,
    batch: int = 32,
    context: int = 2048,
    q_heads: int = 8,
    kv_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    repeats: int = 5,
) -> dict[str, float]:
    """backend='cpu' decode attention over scattered blocks beside a copy of the same K/V bytes."""
    rng = np.random.default_rng(0)
    per_seq = -(-context // block_size)
    shape = (batch * per_seq, block_size, kv_heads, head_dim)
    k = rng.standard_normal(shape).astype(dtype)
    v = rng.standard_normal(shape).astype(dtype)
    q = rng.standard_normal((batch, q_heads, head_dim)).astype(dtype)
    tables = rng.permutation(batch * per_seq).astype(np.int32).reshape(batch, per_seq)
    lens = np.full(batch, context, np.int32)
    dst_k, dst_v = np.empty_like(k), np.empty_like(v)

    def copy() -> None:
        np.copyto(dst_k, k)
        np.copyto(dst_v, v)

    attn_s = best_of(lambda: paged_attention(q, k, v, tables, lens, backend="cpu"), repeats)
    copy_s = best_of(copy, repeats)
    kv_bytes = k.nbytes + v.nbytes
    return {
        "kv_bytes": kv_bytes,
        "attention_gb_per_s": kv_bytes / attn_s / 1e9,
        "copy_gb_per_s": kv_bytes / copy_s / 1e9,
        "attention_over_copy": copy_s / attn_s,
    }


def drive_decode(
    model: LoadedModel, batch: int, prompt_len: int = PROMPT_TOKENS, decode_tokens: int = DECODE_TOKENS
) -> dict[str, float]:
    """``batch`` greedy requests; tokens/s (wall and process CPU) over their decode steps only."""
    rng = np.random.default_rng(batch)
    config = EngineConfig(
        num_blocks=max(64, batch * 4 + 4), block_size=16, max_num_seqs=batch, enable_prefix_caching=False
    )
    engine = LLMEngine(model, config)
    for _ in range(batch):
        prompt = rng.integers(100, model.config.vocab_size, size=prompt_len).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=decode_tokens + 1, ignore_eos=True))
    while engine.stats.generated_tokens < batch and engine.has_unfinished():
        engine.step()  # prefills (and their first tokens)
    start_tokens = engine.stats.generated_tokens
    wall, cpu = time.perf_counter(), time.process_time()
    while engine.has_unfinished():
        engine.step()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tokens = engine.stats.generated_tokens - start_tokens
    return {"tokens": tokens, "tokens_per_s": tokens / wall, "tokens_per_cpu_s": tokens / max(cpu, 1e-9)}


def _pagedkv_rates(
    model: LoadedModel, batches: tuple[int, ...], say: Callable[[str], None]
) -> dict[str, Any]:
    rates = {}
    for batch in batches:
        say(f"pagedkv at batch {batch}")
        rates[str(batch)] = drive_decode(model, batch)
    return rates


def _llama_cpp_rates(
    model_path: str, settings: list[int], batches: tuple[int, ...], say: Callable[[str], None]
) -> dict[str, Any]:
    single, batched = [], []
    for threads in settings:
        say(f"llama.cpp single stream, {threads} thread(s)")
        single.append(llama_cpp_single_stream(model_path, threads))
    for threads in settings:
        say(f"llama.cpp batched at {'/'.join(map(str, batches))} sequences, {threads} thread(s)")
        batched.append(llama_cpp_batch_api(model_path, threads, batches, PROMPT_TOKENS, DECODE_TOKENS))
    return {"llama_cpp_single": single, "llama_cpp_batched": batched}


def decode_comparison(
    model: LoadedModel,
    model_path: str,
    batches: tuple[int, ...] = (1, 8, 32),
    runs: int = 3,
    say: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The measurements of the module docstring: ``runs`` runs, summarized by
    ``decode_report.summarize_runs`` (the runs themselves under ``"runs"``), and the kernel row."""
    tell = say or (lambda _msg: None)
    threads = engine_threads()
    settings = sorted({1, threads})
    measured: list[dict[str, Any]] = []
    for i in range(runs):

        def step(msg: str, i: int = i) -> None:
            tell(f"decode comparison run {i + 1}/{runs}: {msg}")

        run: dict[str, Any] = {}
        llama_cpp_ran = not measured or any(
            "skipped" not in r for r in measured[0]["llama_cpp_single"] + measured[0]["llama_cpp_batched"]
        )
        if i % 2:  # llama.cpp first in every second run, so that neither side always runs first
            run |= _llama_cpp_rates(model_path, settings, batches, step) if llama_cpp_ran else {}
            run["pagedkv"] = _pagedkv_rates(model, batches, step)
        else:
            run["pagedkv"] = _pagedkv_rates(model, batches, step)
            run |= _llama_cpp_rates(model_path, settings, batches, step) if llama_cpp_ran else {}
        if not llama_cpp_ran:  # it did not run in the first run: its notes, not another try
            run |= {key: measured[0][key] for key in ("llama_cpp_single", "llama_cpp_batched")}
        measured.append(run)
    result = summarize_runs(measured)
    result["weights"] = getattr(model.model, "weight_dtype", "fp32")
    result["threads"] = threads
    tell("decode comparison: attention kernel vs copy")
    result["attention_kernel"] = kernel_vs_copy()
    return result
