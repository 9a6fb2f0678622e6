"""``pagedkv generate`` (stream a model's answer) and ``pagedkv bench-engine``."""

from __future__ import annotations

import sys
from typing import Any

from pagedkv.commands import args as cli_args
from pagedkv.commands.output import write_json

__all__ = ["register"]


def register(subparsers: Any) -> None:
    """Add ``generate`` and ``bench-engine`` to the ``pagedkv`` subparsers."""
    gen = subparsers.add_parser("generate", help="generate text with a GGUF llama model on the paged engine")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--model", default=None, help="a llama GGUF file (default: SmolLM2-135M-Instruct)")
    gen.add_argument(
        "--n", type=cli_args.positive_int, default=1, help="samples (forked, sharing the prompt)"
    )
    gen.add_argument("--max-tokens", type=cli_args.positive_int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=cli_args.seed, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument(
        "--offload",
        metavar="STORE",
        default=None,
        help="a store below the cache: redis://HOST:PORT/DB (shared by processes) or a directory",
    )
    gen.add_argument(
        "--offload-capacity-mib",
        type=cli_args.bounded_int(1, 1 << 30),
        default=1024,
        help="a directory store's capacity (MiB)",
    )
    gen.add_argument(
        "--stats",
        action="store_true",
        help="print TTFT, tokens/s, prefix hits and, with --offload, the store's counters to stderr",
    )
    gen.set_defaults(handler=_generate)

    bench = subparsers.add_parser(
        "bench-engine",
        help="paged vs contiguous-reservation engine on real model compute, n=4 sharing, prefix caching",
    )
    bench.add_argument("--model", default=None)
    bench.add_argument("--json", metavar="FILE", default=None, help="write the numbers as one JSON object")
    # Bounds that need no model; check_benchmark refuses the rest before the model loads, and
    # the engine refuses a pool larger than this machine's memory.
    bench.add_argument("--requests", type=cli_args.bounded_int(1, 100_000), default=200)
    bench.add_argument("--num-blocks", type=cli_args.bounded_int(1, 1 << 24), default=64)
    bench.add_argument("--block-size", type=cli_args.bounded_int(1, 1 << 16), default=16)
    bench.add_argument("--max-model-len", type=cli_args.bounded_int(2, 1 << 24), default=256)
    bench.add_argument("--max-prompt", type=cli_args.bounded_int(4, 1 << 24), default=96)
    bench.add_argument("--max-output", type=cli_args.bounded_int(2, 1 << 24), default=48)
    bench.add_argument("--seed", type=cli_args.seed, default=0)
    bench.add_argument(
        "--speculative-ngram",
        metavar="K",
        type=cli_args.bounded_int(0, 64),  # EngineConfig.MAX_SPECULATIVE_NGRAM (checked there too)
        default=0,
        help="prompt-lookup drafts per pass in the throughput engines (0 = off)",
    )
    bench.add_argument(
        "--sections",
        default="throughput,decode,n4,system",
        help="comma-separated subset of throughput,decode,n4,system,memory,scheduling (memory: "
        "sequences a KV budget admits per kv_cache_dtype, and KV bytes with hybrid KV groups vs "
        "every layer full attention, e.g. --model gemma3 --sections memory; scheduling: a "
        "shared-prefix workload under fcfs, lpm and dfs, docs/scheduling.md)",
    )
    bench.add_argument(
        "--decode-runs",
        type=cli_args.bounded_int(1, 100),
        default=3,
        help="the decode section's runs, pagedkv and llama.cpp alternating (ratios within each run)",
    )
    bench.add_argument(
        "--contexts",
        type=cli_args.positive_int_list,
        default=[2048, 8192],
        help="the memory section's context lengths in tokens (comma-separated)",
    )
    bench.add_argument(
        "--kv-budget-mib",
        type=cli_args.bounded_int(1, 1 << 30),
        default=2048,
        help="the memory section's KV budget (MiB) for the admitted batch",
    )
    bench.add_argument(
        "--kv-cache-dtypes",
        default="float16,int8,fp8_e4m3,int4",
        help="the memory section's kv_cache_dtypes, comma-separated (the first is the ratios' baseline)",
    )
    bench.set_defaults(handler=_bench)


def _generate(args: Any) -> int:
    import time

    from pagedkv.engine import LLM, SamplingParams

    params = SamplingParams(  # checked before the model loads: a bad option fails at once
        n=args.n,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    from pagedkv.engine.kv_layout import kv_layout, layer_windows
    from pagedkv.models import load_model

    store = _store(args.offload, args.offload_capacity_mib << 20) if args.offload else None
    model = load_model(args.model)
    # The K/V bytes of 1024 blocks of every layer, whatever the layout: a hybrid layout's block
    # holds fewer layers (Gemma 3: 3 of 18), so it gets proportionally more blocks.
    layout = kv_layout(layer_windows(model.config))
    options: dict[str, Any] = {"offload": store} if store is not None else {}
    if store is not None and layout.is_hybrid:
        options["hybrid_kv"] = False  # the store needs one KV group (docs/offload.md, Limits)
    llm = LLM(model, num_blocks=1024 * layout.num_layers // layout.layers_per_group, block_size=16, **options)
    start = time.perf_counter()
    texts = [""] * args.n
    tokens = 0
    first = None
    for event in llm.stream([args.prompt], params, use_chat_template=args.chat):
        tokens += 1
        first = first if first is not None else time.perf_counter() - start
        texts[event.index] += event.text
        if args.n == 1:
            sys.stdout.write(event.text)
            sys.stdout.flush()
    if args.n == 1:
        sys.stdout.write("\n")
    else:
        for i, text in enumerate(texts):
            sys.stdout.write(f"--- sample {i} ---\n{text}\n")
    if args.stats:
        elapsed = time.perf_counter() - start
        print(
            f"TTFT {first or 0:.2f} s, {tokens} tokens in {elapsed:.2f} s ({tokens / elapsed:.1f} tok/s)",
            file=sys.stderr,
        )
        engine = llm.last_engine
        if engine is not None:
            s = engine.stats
            print(f"prefix cache: {s.prefix_hit_tokens} prompt tokens served", file=sys.stderr)
            if store is not None:
                print(
                    f"store: {s.store_hit_tokens} prompt tokens served, {s.store_deadline_misses} "
                    f"look-ups past the deadline; {s.store_puts_written} blocks written, "
                    f"{s.store_puts_dropped} dropped, {s.store_puts_failed} failed",
                    file=sys.stderr,
                )
    return 0


def _store(spec: str, capacity_bytes: int) -> Any:
    """A ``RedisStore`` for a ``redis://`` (or ``rediss://``, ``unix://``) URL, else a
    ``DiskStore`` in the directory ``spec``."""
    from pagedkv.offload import DiskStore, RedisStore

    if spec.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(spec)
    return DiskStore(spec, capacity_bytes=capacity_bytes)


def _bench(args: Any) -> int:
    from pagedkv.benchmarks.engine import SECTIONS, check_benchmark, run_benchmark
    from pagedkv.models import load_model

    sections = tuple(args.sections.split(","))
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        raise cli_args.CliError(f"unknown --sections {','.join(unknown)}: choose from {','.join(SECTIONS)}")
    if "memory" in sections and min(args.contexts) < 2:
        raise cli_args.CliError(
            f"--contexts must be >= 2 tokens (a prompt and a generated token), got {args.contexts}"
        )
    from pagedkv.engine.kv_budget import ENGINE_KV_CACHE_DTYPES

    dtypes = tuple(args.kv_cache_dtypes.split(","))
    if not all(d in ENGINE_KV_CACHE_DTYPES for d in dtypes):
        raise cli_args.CliError(
            f"--kv-cache-dtypes: choose from {','.join(ENGINE_KV_CACHE_DTYPES)}, got {args.kv_cache_dtypes}"
        )
    check_benchmark(
        num_requests=args.requests,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_prompt=args.max_prompt,
        max_output=args.max_output,
        seed=args.seed,
        sections=sections,
        speculative_ngram=args.speculative_ngram,
    )
    if sections == ("memory",):
        model: Any = _ConfigOnly(_header_config(args.model))  # the section reads no weight
    else:
        model = load_model(args.model)
    result = run_benchmark(
        model,
        num_requests=args.requests,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_prompt=args.max_prompt,
        max_output=args.max_output,
        seed=args.seed,
        sections=sections,
        speculative_ngram=args.speculative_ngram,
        memory_contexts=tuple(args.contexts),
        kv_budget_bytes=args.kv_budget_mib << 20,
        kv_cache_dtypes=dtypes,
        progress=lambda msg: print(f"bench-engine: {msg}", file=sys.stderr, flush=True),
        checkpoint=(lambda partial: write_json(args.json, partial)) if args.json else None,
    )
    if "decode" in sections:  # pagedkv at batch 1/8/32 beside llama.cpp (single, batched), kernel vs copy
        from pagedkv.benchmarks.decode import decode_comparison, print_decode_comparison
        from pagedkv.models.llama.locate import default_model_path

        path = str(args.model or default_model_path())
        result["decode_comparison"] = decode_comparison(
            model,
            path,
            runs=args.decode_runs,
            say=lambda msg: print(f"bench-engine: {msg}", file=sys.stderr, flush=True),
        )
    _print(result)
    if "decode_comparison" in result:
        print_decode_comparison(result["decode_comparison"])
    if args.json:
        write_json(args.json, result)
    return 0


class _ConfigOnly:
    """A model stand-in carrying only its config (the memory section needs nothing else)."""

    def __init__(self, config: Any) -> None:
        self.config = config


def _header_config(model: str | None) -> Any:
    """The config of the model ``load_model(model)`` would load, from the GGUF header alone for a
    Gemma 3 file (seconds instead of loading 1 GB of fp32 weights); other models load."""
    from pagedkv.models import load_model
    from pagedkv.models.gemma3.file import read_gemma3_config
    from pagedkv.models.gemma3.locate import GEMMA3_MODEL_NAME, gemma3_model_path
    from pagedkv.models.gguf_arch import gguf_architecture
    from pagedkv.models.llama.locate import default_model_path

    path = default_model_path() if model is None else model
    if str(path) == GEMMA3_MODEL_NAME:
        path = gemma3_model_path()
    if gguf_architecture(path) == "gemma3":
        return read_gemma3_config(path)
    return load_model(path).config


def _print(result: dict[str, Any]) -> None:
    if "throughput" in result:
        _print_throughput(result["throughput"])
    for batch, d in result.get("decode", {}).items():
        print(f"decode batch {batch:>3}: {d['tokens_per_cpu_s']:.2f} tok/CPU-s")
    if "n4_sampling" in result:
        n4 = result["n4_sampling"]
        print(f"n=4 peak blocks: {n4['max_blocks_shared']} shared vs {n4['max_blocks_separate']} separate")
    if "system_prompt" in result:
        sp = result["system_prompt"]
        print(
            f"system prompt: prefill tokens {sp['prefill_tokens_off']} -> {sp['prefill_tokens_on']} "
            f"({sp['prefill_ratio']:.1f}x fewer), "
            f"mean TTFT {sp['mean_ttft_s_off']:.2f} -> {sp['mean_ttft_s_on']:.2f} s"
        )
    if "memory" in result:
        _print_memory(result["memory"])


def _print_throughput(t: dict[str, Any]) -> None:
    p, c = t["paged"], t["contiguous"]
    print(f"{'engine':<12}{'req/s':>9}{'tok/s':>9}{'tok/cpu-s':>11}{'mean batch':>12}{'max blocks':>12}")
    for name, r in (("paged", p), ("contiguous", c)):
        print(
            f"{name:<12}{r['requests_per_s']:>9.3f}{r['tokens_per_s']:>9.2f}{r['tokens_per_cpu_s']:>11.2f}"
            f"{r['mean_batch']:>12.1f}{r['max_blocks_in_use']:>12d}"
        )
    if p["draft_tokens"]:
        print(
            f"speculative (paged): {p['acceptance_rate']:.1%} of {p['draft_tokens']} drafts accepted, "
            f"{p['tokens_per_pass']:.2f} tokens per sequence per decode pass"
        )
    print(
        f"paged / contiguous: {t['tokens_per_cpu_s_ratio']:.2f}x tokens per CPU-second, "
        f"{t['tokens_per_s_ratio']:.2f}x tokens/s, {t['mean_batch_ratio']:.2f}x mean batch"
    )


def _print_memory(m: dict[str, Any]) -> None:
    h, f = m["hybrid"], m["all_full"]
    print(
        f"KV memory (block size {m['block_size']}; hybrid: {len(h['kv_groups'])} groups of "
        f"{h['layers_per_group']} layers, {h['bytes_per_block']:,} B/block; all full: "
        f"{f['bytes_per_block']:,} B/block)"
    )
    budget = m["budget_bytes"] / 2**20
    print(
        f"{'context':>8}{'hybrid MiB':>12}{'all-full MiB':>14}{'ratio':>8}{f'batch @ {budget:,.0f} MiB':>22}"
    )
    for context, ratio in m["ratio"].items():
        hc, fc = h["contexts"][context], f["contexts"][context]
        print(
            f"{context:>8}{hc['kv_bytes_in_use'] / 2**20:>12.1f}{fc['kv_bytes_in_use'] / 2**20:>14.1f}"
            f"{ratio:>8.1%}{hc['batch_admitted']:>11d} vs {fc['batch_admitted']:<6d}"
            + (" (capped)" if hc["batch_capped"] or fc["batch_capped"] else "")
        )
    dtypes = m["dtypes"]
    base = next(iter(dtypes))
    print(
        f"Sequences admitted at {budget:,.0f} MiB of K/V by kv_cache_dtype "
        f"(engine layout, block {m['block_size']}):"
    )
    print(
        f"{'dtype':>10}{'B/block':>10}{'residual B/seq':>16}" + "".join(f"{f'@ {c}':>18}" for c in m["ratio"])
    )
    for dtype, d in dtypes.items():
        cells = "".join(
            f"{d['contexts'][c]['batch_admitted']:>8d} ({d['contexts'][c][f'vs_{base}'] or 0:.2f}x)"
            + ("+" if d["contexts"][c]["batch_capped"] else " ")
            for c in m["ratio"]
        )
        print(f"{dtype:>10}{d['bytes_per_block']:>10,}{d['residual_bytes_per_sequence']:>16,}{cells}")
    prefill = m.get("chunked_prefill", {})
    if prefill:
        print("During a chunked prefill (the engine's scheduler, per-chunk allocation; peak over its steps):")
        print(f"{'context':>8}{'chunk':>7}{'steps':>7}{'peak MiB':>10}{'all-full MiB':>14}{'peak ratio':>12}")
        for context, p in prefill.items():
            print(
                f"{context:>8}{p['chunk']:>7}{len(p['steps']):>7}{p['peak_bytes'] / 2**20:>10.1f}"
                f"{p['all_full_bytes'] / 2**20:>14.1f}{p['peak_ratio']:>12.1%}"
            )
