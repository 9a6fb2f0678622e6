"""llama.cpp's decode rates, measured inside the interpreter that has ``llama_cpp`` (llama-cpp-python).

``pagedkv.benchmarks.llama_cpp_baseline`` runs this file's source with ``python -c`` in a
subprocess (``PAGEDKV_LLAMA_PYTHON``), so it imports nothing but the standard library and
``llama_cpp``, and prints one JSON line. Two modes:

- ``single MODEL THREADS PROMPT_TOKENS DECODE_TOKENS``: llama-cpp-python's ``Llama.generate``
  (greedy), the single-stream number of the earlier results files;
- ``batch MODEL THREADS PROMPT_TOKENS DECODE_TOKENS B [B ...]``: llama.cpp's own batch API, as its
  ``examples/batched`` drives it: one context with ``n_seq_max = B`` (llama.cpp's default
  ``kv_unified = false``: each sequence its own KV stream), a different prompt per sequence
  decoded into its own ``seq_id``, then per step one ``llama_batch`` of B tokens (one per sequence,
  its own position, logits on) through ``llama_decode`` and llama.cpp's greedy sampler on each
  sequence's row. Timed over the decode steps only, as ``drive_decode`` times the engine.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import random
import sys
import time
from typing import Any

__all__ = ["main", "measure_batch_api", "measure_single_stream"]


def measure_single_stream(
    lc: Any, model_path: str, threads: int, prompt_tokens: int, decode_tokens: int
) -> dict[str, Any]:
    """llama-cpp-python's high-level greedy stream: ``decode_tokens`` tokens after the first."""
    llm = lc.Llama(
        model_path=model_path, n_threads=threads, n_threads_batch=threads, n_ctx=512, verbose=False
    )
    gen = llm.generate(list(range(100, 100 + prompt_tokens)), top_k=1, temp=0.0)
    next(gen)  # the prefill and the first token
    wall, cpu = time.perf_counter(), time.process_time()
    for _tok in itertools.islice(gen, decode_tokens):
        pass
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {**_rates(decode_tokens, wall, cpu), "threads": threads}


def measure_batch_api(
    lc: Any, model_path: str, threads: int, batches: list[int], prompt_tokens: int, decode_tokens: int
) -> dict[str, Any]:
    """llama.cpp's batched greedy decode at each batch size (one context each, same model)."""
    quiet = lc.llama_log_callback(lambda _level, _text, _user: None)  # kept alive until the end
    lc.llama_log_set(quiet, ctypes.c_void_p(0))
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(model_path.encode(), lc.llama_model_default_params())
    if not model:
        raise SystemExit(f"llama.cpp could not load {model_path}")
    try:
        vocab_size = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
        rows = {
            str(b): _batched_decode(lc, model, vocab_size, threads, b, prompt_tokens, decode_tokens)
            for b in batches
        }
    finally:
        lc.llama_model_free(model)
    return {"threads": threads, "batches": rows}


def _batched_decode(
    lc: Any,
    model: Any,
    vocab_size: int,
    threads: int,
    batch_size: int,
    prompt_tokens: int,
    decode_tokens: int,
) -> dict[str, float]:
    params = lc.llama_context_default_params()
    params.n_seq_max = batch_size
    params.n_ctx = batch_size * (prompt_tokens + decode_tokens + 1)  # llama.cpp pads each sequence to 256
    params.n_batch = params.n_ubatch = max(batch_size, prompt_tokens)
    params.n_threads = params.n_threads_batch = threads
    ctx = lc.llama_init_from_model(model, params)
    if not ctx:
        raise SystemExit(f"llama.cpp could not make a context for {batch_size} sequences")
    batch = lc.llama_batch_init(max(batch_size, prompt_tokens), 0, 1)
    sampler = lc.llama_sampler_init_greedy()
    try:
        rng = random.Random(batch_size)
        last, pos = [], []
        for seq in range(batch_size):  # the prefills, one sequence per llama_decode, untimed
            prompt = [rng.randrange(100, vocab_size) for _ in range(prompt_tokens)]
            _fill(batch, [(token, p, seq, p == prompt_tokens - 1) for p, token in enumerate(prompt)])
            _decode(lc, ctx, batch)
            last.append(lc.llama_sampler_sample(sampler, ctx, prompt_tokens - 1))
            pos.append(prompt_tokens)
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(decode_tokens):  # one token per sequence per step; row i is sequence i
            _fill(batch, [(last[seq], pos[seq], seq, True) for seq in range(batch_size)])
            _decode(lc, ctx, batch)
            for seq in range(batch_size):
                last[seq] = lc.llama_sampler_sample(sampler, ctx, seq)
                pos[seq] += 1
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        lc.llama_sampler_free(sampler)
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
    return _rates(batch_size * decode_tokens, wall, cpu)


def _fill(batch: Any, rows: list[tuple[int, int, int, bool]]) -> None:
    """Writes (token, position, seq_id, wants logits) rows into a ``llama_batch``."""
    for i, (token, pos, seq, logits) in enumerate(rows):
        batch.token[i] = token
        batch.pos[i] = pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = 1 if logits else 0
    batch.n_tokens = len(rows)


def _decode(lc: Any, ctx: Any, batch: Any) -> None:
    status = lc.llama_decode(ctx, batch)
    if status != 0:
        raise SystemExit(f"llama_decode returned {status}")


def _rates(tokens: int, wall_s: float, cpu_s: float) -> dict[str, float]:
    return {"tokens": tokens, "tokens_per_s": tokens / wall_s, "tokens_per_cpu_s": tokens / max(cpu_s, 1e-9)}


def main(argv: list[str]) -> int:
    import llama_cpp

    mode, path, threads, prompt_tokens, decode_tokens = (
        argv[0],
        argv[1],
        int(argv[2]),
        int(argv[3]),
        int(argv[4]),
    )
    if mode == "single":
        row = measure_single_stream(llama_cpp, path, threads, prompt_tokens, decode_tokens)
    else:
        row = measure_batch_api(
            llama_cpp, path, threads, [int(b) for b in argv[5:]], prompt_tokens, decode_tokens
        )
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
