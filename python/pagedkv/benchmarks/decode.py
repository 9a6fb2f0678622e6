"""The decode comparison of ``pagedkv bench-engine --sections decode``: one run, three numbers.

1. pagedkv's aggregate decode tokens/s at batch 1 / 8 / 32 (16-token prompts, greedy, the
   default data plane), timed over decode steps only (the prefills run first).
2. llama.cpp's single stream on the same GGUF file, greedy, with 1 thread and with
   ``os.cpu_count()`` threads (on a busy machine its spinning threads collapse at 2: the ratios
   use its faster setting), when ``llama_cpp`` imports in the interpreter
   ``PAGEDKV_LLAMA_PYTHON`` names (default: this one); it runs in a subprocess so that its
   threads and ours never share a process. Skipped with a note otherwise.
3. The CPU paged decode attention kernel's bytes/s of K/V read (batch 32, 2 K context, 8 query /
   2 KV heads of 64, fp32) beside ``np.copyto`` of the same bytes.

pagedkv's default weight mode (``int8``) reads the file's codes (4-bit ones packed two per
byte) with an fp32 scale and offset per block and quantizes activations to 8 bits, as llama.cpp
does with the file's blocks themselves: at batch 1 pagedkv streams ~1.2x llama.cpp's weight bytes
(0.75 against 0.625 bytes per Q4_1 weight: fp32 scales and offsets where the file has fp16).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from pagedkv.attention import paged_attention
from pagedkv.engine.llm_engine import EngineConfig, LLMEngine
from pagedkv.engine.params import SamplingParams
from pagedkv.models import LoadedModel

__all__ = ["best_of", "decode_comparison", "drive_decode", "kernel_vs_copy", "print_decode_comparison"]

# Runs in the llama.cpp interpreter: argv = model path, threads, prompt token count, decode tokens.
_LLAMA_SCRIPT = """
import json, sys, time
from llama_cpp import Llama
path, threads, n_prompt, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=512, verbose=False)
tokens = list(range(100, 100 + n_prompt))
gen = llm.generate(tokens, top_k=1, temp=0.0)
next(gen)  # the prefill and the first token
start = time.perf_counter()
for _, _tok in zip(range(n), gen):
    pass
print(json.dumps({"tokens": n, "tokens_per_s": n / (time.perf_counter() - start), "threads": threads}))
"""


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
    model: LoadedModel, batch: int, prompt_len: int = 16, decode_tokens: int = 16
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


def llama_cpp_single_stream(model_path: str, threads: int, decode_tokens: int = 64) -> dict[str, Any]:
    """llama.cpp's greedy single-stream decode rate in a subprocess, or a note why it did not run."""
    python = os.environ.get("PAGEDKV_LLAMA_PYTHON", sys.executable)
    try:
        done = subprocess.run(
            [python, "-c", _LLAMA_SCRIPT, model_path, str(threads), "16", str(decode_tokens)],
            capture_output=True,
            text=True,
            timeout=600,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"skipped": f"llama.cpp did not run ({python}): {exc}"}
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        return {"skipped": f"llama_cpp does not run in {python} (set PAGEDKV_LLAMA_PYTHON): {last}"}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def decode_comparison(
    model: LoadedModel, model_path: str, batches: tuple[int, ...] = (1, 8, 32), say: Any = None
) -> dict[str, Any]:
    """The three measurements of the module docstring, with ratios to llama.cpp when it ran."""
    say = say or (lambda _msg: None)
    result: dict[str, Any] = {"pagedkv": {}, "weights": getattr(model.model, "weight_dtype", "fp32")}
    for batch in batches:
        say(f"decode comparison: pagedkv at batch {batch}")
        result["pagedkv"][str(batch)] = drive_decode(model, batch)
    runs = []
    for threads in sorted({1, os.cpu_count() or 1}):
        say(f"decode comparison: llama.cpp single stream, {threads} threads")
        runs.append(llama_cpp_single_stream(model_path, threads))
    ran = [r for r in runs if "tokens_per_s" in r]
    llama = max(ran, key=lambda r: r["tokens_per_s"]) if ran else runs[-1]
    result["llama_cpp"] = llama
    result["llama_cpp_runs"] = runs
    if "tokens_per_s" in llama:
        result["ratio_to_llama_cpp"] = {
            b: r["tokens_per_s"] / llama["tokens_per_s"] for b, r in result["pagedkv"].items()
        }
    say("decode comparison: attention kernel vs copy")
    result["attention_kernel"] = kernel_vs_copy()
    return result


def print_decode_comparison(result: dict[str, Any]) -> None:
    llama = result["llama_cpp"]
    print(f"pagedkv weights: {result.get('weights', 'fp32')} (PAGEDKV_WEIGHTS; docs/cpu_data_plane.md)")
    for batch, r in result["pagedkv"].items():
        ratio = result.get("ratio_to_llama_cpp", {}).get(batch)
        vs = f" = {ratio:.2f}x llama.cpp's single stream" if ratio is not None else ""
        print(f"pagedkv decode batch {batch:>3}: {r['tokens_per_s']:.1f} tok/s{vs}")
    if "tokens_per_s" in llama:
        for r in result.get("llama_cpp_runs", [llama]):
            if "tokens_per_s" in r:
                print(f"llama.cpp single stream ({r['threads']} threads): {r['tokens_per_s']:.1f} tok/s")
    else:
        print(f"llama.cpp: {llama['skipped']}")
    k = result["attention_kernel"]
    print(
        f"attention kernel: {k['attention_gb_per_s']:.2f} GB/s of K/V vs copy {k['copy_gb_per_s']:.2f} GB/s "
        f"({k['attention_over_copy']:.2f}x)"
    )
