"""What save-on-compute costs the engine's step, in one run: SmolLM2 through ``LLMEngine`` with
no offload, with a ``DiskStore`` under ``offload_policy="evict"`` and under ``"compute"``.

    python benches/offload_save.py [--rounds 3] [--prompts 4] [--prompt-tokens 128]
                                   [--decode-seqs 8] [--decode-tokens 32]

Two workloads, fresh random prompts every round (no prefix hits, so every block is computed):

- prefill: ``--prompts`` prompts of ``--prompt-tokens`` tokens, one output token each: prompt
  tokens per second (every full block is saved under "compute");
- decode: ``--decode-seqs`` 16-token prompts decoding ``--decode-tokens`` tokens each:
  generated tokens per second (a block is saved every 16 tokens per sequence).

The pool holds every sequence (nothing is evicted: "evict" writes nothing, the cost it shows
is the host tier's bookkeeping). Each round runs the three engines in a rotated order, each on
its own empty store; a ratio is the median of the per-round ratios to "no offload" (the
machine is shared: read the ratios). ``save_s`` is the time the step spent in
``StoreSaves.save_computed`` (the copies out of the device caches and the queueing); the
worker thread's writes run beside the step and cost wall time only through the shared cores.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.models import load_model
from pagedkv.offload import DiskStore

POLICIES = ("none", "evict", "compute")


def _run(model: Any, policy: str, work: list[tuple[list[int], int]], directory: Path) -> dict[str, float]:
    options: dict[str, Any] = {}
    if policy != "none":
        options = {"offload": DiskStore(directory, capacity_bytes=8 << 30), "offload_policy": policy}
    blocks = sum(-(-(len(p) + n) // 16) for p, n in work) + 4
    config = EngineConfig(
        num_blocks=blocks, block_size=16, max_num_seqs=64, max_num_batched_tokens=512, **options
    )
    engine = LLMEngine(model, config)
    saves = engine.runner.saves
    save_s = 0.0
    if saves is not None:
        inner = saves.save_computed

        def timed(blocks: Any, hashes: Any) -> None:
            nonlocal save_s
            start = time.perf_counter()
            inner(blocks, hashes)
            save_s += time.perf_counter() - start

        saves.save_computed = timed  # type: ignore[method-assign]
    for prompt, out in work:
        engine.add_request(prompt, SamplingParams(max_tokens=out, ignore_eos=True))
    wall = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    wall = time.perf_counter() - wall
    engine.close(timeout_s=60.0)
    prompt_tokens = sum(len(p) for p, _ in work)
    generated = sum(n for _, n in work)
    return {
        "wall_s": wall,
        "prompt_tokens_per_s": prompt_tokens / wall,
        "generated_tokens_per_s": generated / wall,
        "save_s": save_s,
        "saved": float(saves.blocks_saved_on_compute if saves else 0),
        "dropped": float(saves.puts_dropped if saves else 0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-seqs", type=int, default=8)
    parser.add_argument("--decode-tokens", type=int, default=32)
    args = parser.parse_args()
    model = load_model()
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    workloads = {
        "prefill": (
            "prompt_tokens_per_s",
            lambda: [(rng.integers(100, vocab, args.prompt_tokens).tolist(), 1) for _ in range(args.prompts)],
        ),
        "decode": (
            "generated_tokens_per_s",
            lambda: [
                (rng.integers(100, vocab, 16).tolist(), args.decode_tokens) for _ in range(args.decode_seqs)
            ],
        ),
    }
    for name, (metric, make) in workloads.items():
        runs: dict[str, list[dict[str, float]]] = {p: [] for p in POLICIES}
        for r in range(args.rounds):
            work = make()
            order = POLICIES[r % 3 :] + POLICIES[: r % 3]
            for policy in order:
                with tempfile.TemporaryDirectory() as tmp:
                    runs[policy].append(_run(model, policy, work, Path(tmp)))
        print(f"## {name} ({metric}, {args.rounds} rounds)")
        print("| engine | tokens/s | ratio to no offload | save_s / wall | blocks saved | dropped |")
        print("|---|---:|---:|---:|---:|---:|")
        for policy in POLICIES:
            ratios = [
                run[metric] / base[metric] for run, base in zip(runs[policy], runs["none"], strict=True)
            ]
            share = statistics.median(run["save_s"] / run["wall_s"] for run in runs[policy])
            print(
                f"| {policy} | {statistics.median(run[metric] for run in runs[policy]):.1f} "
                f"| {100 * statistics.median(ratios):.1f} % | {100 * share:.2f} % "
                f"| {runs[policy][-1]['saved']:.0f} | {sum(run['dropped'] for run in runs[policy]):.0f} |"
            )
        print()


if __name__ == "__main__":
    main()
