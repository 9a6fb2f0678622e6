"""The engine benchmark (``pagedkv bench-engine``): real model compute, ratios from one run.

1. Throughput at one KV budget: a ShareGPT-like workload (lognormal prompt and output lengths)
   through the paged engine and through the contiguous-reservation engine (each running request
   reserves ``max_model_len`` slots of the same pool): requests/s, generated tokens per second of
   wall time and of process CPU time, mean running batch, KV blocks in use.
2. Decode throughput at batch 1 / 8 / 32 (generated tokens per CPU-second).
3. ``n = 4`` sampling: peak KV blocks with fork sharing against four independent requests.
4. A shared system prompt with and without prefix caching: prefill tokens computed, mean TTFT.
5. ``memory`` (not in the default run): sequences a fixed KV budget admits per ``kv_cache_dtype``
   (float16, int8, fp8_e4m3, int4: docs/quantized_kv.md), and KV bytes in use at long contexts
   with hybrid KV groups against every layer full attention, and the batch a fixed KV budget admits
   (``benchmarks/memory.py``; for Gemma 3, ``--model gemma3 --sections memory``).
6. ``scheduling`` (not in the default run): a shared-prefix workload admitted in fcfs, lpm and
   dfs order (``benchmarks/scheduling.py``): throughput and prompt tokens computed, as ratios to
   FCFS from the same run.

CPU time is reported next to wall time because the machine may be shared: process CPU time is
what this process actually computed.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from pagedkv.benchmarks.memory import DEFAULT_BUDGET_BYTES, DEFAULT_CONTEXTS, DEFAULT_DTYPES, kv_memory
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.params import SamplingParams
from pagedkv.errors import InvalidArgumentError
from pagedkv.models import LoadedModel

__all__ = [
    "DEFAULT_SECTIONS",
    "MAX_BENCH_REQUESTS",
    "SECTIONS",
    "check_benchmark",
    "run_benchmark",
    "sharegpt_like",
]

SECTIONS = ("throughput", "decode", "n4", "system", "memory", "scheduling")
DEFAULT_SECTIONS = ("throughput", "decode", "n4", "system")
# Each request is real model compute (seconds of CPU): far more than any useful run, and small
# enough that the workload's token lists fit in memory.
MAX_BENCH_REQUESTS = 100_000


def sharegpt_like(
    num_requests: int, vocab: int, seed: int, max_prompt: int, max_output: int
) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) pairs: lognormal lengths shaped like ShareGPT's (long
    tail, median prompt ~ max_prompt / 4), scaled down to what a CPU can run."""
    rng = np.random.default_rng(seed)
    prompts = np.clip(rng.lognormal(np.log(max_prompt / 4), 0.7, num_requests), 4, max_prompt).astype(int)
    outputs = np.clip(rng.lognormal(np.log(max_output / 3), 0.7, num_requests), 2, max_output).astype(int)
    return [
        (rng.integers(100, vocab, size=int(p)).tolist(), int(o))
        for p, o in zip(prompts, outputs, strict=True)
    ]


def _drive(
    model: LoadedModel, config: EngineConfig, work: list[tuple[list[int], int]], **sampling: Any
) -> dict:
    engine = LLMEngine(model, config)
    for prompt, out in work:
        engine.add_request(prompt, SamplingParams(max_tokens=out, ignore_eos=True, **sampling))
    wall, cpu = time.perf_counter(), time.process_time()
    while engine.has_unfinished():
        engine.step()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    s = engine.stats.summary()
    ttfts = [engine.output(r).ttft_s or 0.0 for r in engine.requests]
    return {
        **s,
        "requests": len(work),
        "wall_s": wall,
        "cpu_s": cpu,
        "requests_per_s": len(work) / wall,
        "tokens_per_s": s["generated_tokens"] / wall,
        "tokens_per_cpu_s": s["generated_tokens"] / cpu,
        "mean_ttft_s": float(np.mean(ttfts)),
        "kv_bytes_per_block": engine.store.kv_bytes // engine.config.pool_blocks,
    }


def check_benchmark(
    *,
    num_requests: int,
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    max_prompt: int,
    max_output: int,
    seed: int,
    sections: tuple[str, ...] = SECTIONS,
    speculative_ngram: int = 0,
) -> None:
    """InvalidArgumentError unless every engine the benchmark builds accepts its configuration and
    every request of its workload fits: checked before the model is loaded, so that a bad option
    is refused at once rather than after minutes of compute."""
    for name, value, low, high in (
        ("requests", num_requests, 1, MAX_BENCH_REQUESTS),
        ("max_prompt", max_prompt, 4, None),
        ("max_output", max_output, 2, None),
        ("seed", seed, 0, 2**64 - 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high and value > high):
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise InvalidArgumentError(f"{name} must be an integer {bound}, got {value!r}")
    # The throughput section's two engines (the others use the same pool or a larger one).
    EngineConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        reservation="contiguous",
        speculative_ngram=speculative_ngram,
    )
    if "throughput" in sections and max_model_len > num_blocks * block_size:
        raise InvalidArgumentError(
            f"the contiguous engine reserves max_model_len = {max_model_len} slots per "
            f"request; the pool has {num_blocks} x {block_size} = {num_blocks * block_size}"
        )
    if max_prompt >= max_model_len:
        raise InvalidArgumentError(
            f"max_prompt = {max_prompt} leaves no room for an output in max_model_len = {max_model_len}"
        )
    # The n4 and system sections use fixed prompts: 4 samples of 64 + 8 tokens sharing the full
    # prompt blocks, and 104 + 4 tokens.
    shared = 64 // block_size
    for section, blocks in (
        ("n4", shared + 4 * -(-(72 - shared * block_size) // block_size)),
        ("system", -(-108 // block_size)),
    ):
        if section in sections and blocks > num_blocks:
            raise InvalidArgumentError(
                f"the {section} section needs {blocks} blocks of {block_size}; num_blocks is {num_blocks}"
            )


def run_benchmark(
    model: LoadedModel,
    *,
    num_requests: int = 200,
    num_blocks: int = 64,
    block_size: int = 16,
    max_model_len: int = 256,
    max_prompt: int = 96,
    max_output: int = 48,
    seed: int = 0,
    decode_batches: tuple[int, ...] = (1, 8, 32),
    progress: Any = None,
    sections: tuple[str, ...] = DEFAULT_SECTIONS,
    checkpoint: Any = None,
    speculative_ngram: int = 0,
    memory_contexts: tuple[int, ...] = DEFAULT_CONTEXTS,
    kv_budget_bytes: int = DEFAULT_BUDGET_BYTES,
    kv_cache_dtypes: tuple[str, ...] = DEFAULT_DTYPES,
) -> dict[str, Any]:
    """Run ``sections``; ``checkpoint(result)``, when given, is called with the numbers so far
    after every engine run, so that a long run interrupted late still leaves its finished parts."""
    check_benchmark(
        num_requests=num_requests,
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        max_prompt=max_prompt,
        max_output=max_output,
        seed=seed,
        sections=sections,
        speculative_ngram=speculative_ngram,
    )
    say = progress or (lambda _msg: None)
    save = checkpoint or (lambda _result: None)
    vocab = model.config.vocab_size
    work = sharegpt_like(num_requests, vocab, seed, max_prompt, max_output)
    base: dict[str, Any] = {
        "num_blocks": num_blocks,
        "block_size": block_size,
        "max_model_len": max_model_len,
        "speculative_ngram": speculative_ngram,  # the throughput engines' drafts per pass
    }
    result: dict[str, Any] = {
        "workload": {
            "requests": num_requests,
            **base,
            "max_prompt": max_prompt,
            "max_output": max_output,
            "seed": seed,
        }
    }
    if "throughput" in sections:
        _throughput(model, base, work, result, say, save)
        save(result)
    if "decode" in sections:
        _decode(model, decode_batches, num_blocks, seed, vocab, result, say)
        save(result)
    if "n4" in sections:
        _n4(model, num_blocks, block_size, seed, work, result, say)
        save(result)
    if "system" in sections:
        _system(model, num_blocks, block_size, seed, vocab, result, say)
        save(result)
    if "memory" in sections:
        say("memory: hybrid KV groups vs every layer full attention; sequences per kv_cache_dtype")
        result["memory"] = kv_memory(
            model.config,
            contexts=memory_contexts,
            block_size=block_size,
            budget_bytes=kv_budget_bytes,
            kv_cache_dtypes=kv_cache_dtypes,
        )
        save(result)
    if "scheduling" in sections:
        from pagedkv.benchmarks.scheduling import run_scheduling

        result["scheduling"] = run_scheduling(model, seed=seed, block_size=block_size, say=say)
        save(result)
    return result


def _throughput(
    model: LoadedModel, base: dict[str, Any], work: list, result: dict[str, Any], say: Any, save: Any
) -> None:
    say("throughput: paged")
    paged = _drive(model, EngineConfig(**base, max_num_seqs=256, enable_prefix_caching=False), work)
    result["throughput"] = {"paged": paged}
    save(result)
    say("throughput: contiguous reservation")
    contiguous = _drive(
        model,
        EngineConfig(**base, max_num_seqs=256, enable_prefix_caching=False, reservation="contiguous"),
        work,
    )
    result["throughput"] = {
        "paged": paged,
        "contiguous": contiguous,
        "tokens_per_cpu_s_ratio": paged["tokens_per_cpu_s"] / contiguous["tokens_per_cpu_s"],
        "tokens_per_s_ratio": paged["tokens_per_s"] / contiguous["tokens_per_s"],
        "mean_batch_ratio": paged["mean_batch"] / max(contiguous["mean_batch"], 1e-9),
    }


def _decode(
    model: LoadedModel,
    decode_batches: tuple[int, ...],
    num_blocks: int,
    seed: int,
    vocab: int,
    result: dict[str, Any],
    say: Any,
) -> None:
    decode = {}
    for batch in decode_batches:
        say(f"decode at batch {batch}")
        rng = np.random.default_rng(seed + batch)
        prompts = [(rng.integers(100, vocab, size=16).tolist(), 8) for _ in range(batch)]
        blocks = max(num_blocks, batch * 2 + 2)
        run = _drive(
            model,
            EngineConfig(num_blocks=blocks, block_size=16, max_num_seqs=batch, enable_prefix_caching=False),
            prompts,
        )
        decode[str(batch)] = {
            "tokens_per_cpu_s": run["tokens_per_cpu_s"],
            "tokens_per_s": run["tokens_per_s"],
            "mean_batch": run["mean_batch"],
        }
    result["decode"] = decode


def _n4(
    model: LoadedModel,
    num_blocks: int,
    block_size: int,
    seed: int,
    work: list,
    result: dict[str, Any],
    say: Any,
) -> None:
    say("n=4 sampling memory")
    prompt = work[0][0][:64] + list(range(200, 200 + max(0, 64 - len(work[0][0]))))
    shared = _drive(
        model,
        EngineConfig(num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=False),
        [(prompt, 8)],
        n=4,
        temperature=0.8,
        seed=seed,
    )
    separate = _drive(
        model,
        EngineConfig(num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=False),
        [(prompt, 8)] * 4,
        temperature=0.8,
        seed=seed,
    )
    result["n4_sampling"] = {
        "prompt_tokens": len(prompt),
        "max_blocks_shared": shared["max_blocks_in_use"],
        "max_blocks_separate": separate["max_blocks_in_use"],
    }


def _system(
    model: LoadedModel,
    num_blocks: int,
    block_size: int,
    seed: int,
    vocab: int,
    result: dict[str, Any],
    say: Any,
) -> None:
    say("system prompt: prefix caching off / on")
    rng = np.random.default_rng(seed + 1)
    system = rng.integers(100, vocab, size=96).tolist()
    sys_work = [(system + rng.integers(100, vocab, size=8).tolist(), 4) for _ in range(8)]
    off = _drive(
        model,
        EngineConfig(num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=False),
        sys_work,
    )
    on = _drive(
        model,
        EngineConfig(num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=True),
        sys_work,
    )
    result["system_prompt"] = {
        "requests": len(sys_work),
        "prefill_tokens_off": off["prefill_tokens"],
        "prefill_tokens_on": on["prefill_tokens"],
        "prefill_ratio": off["prefill_tokens"] / max(on["prefill_tokens"], 1),
        "mean_ttft_s_off": off["mean_ttft_s"],
        "mean_ttft_s_on": on["mean_ttft_s"],
        "prefix_hit_tokens": on["prefix_hit_tokens"],
    }
