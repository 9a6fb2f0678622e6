"""Differential run of pagedkv's prefix cache against vLLM v1's real ``KVCacheManager`` under
chunked prefill: the same randomized schedules (prompts sharing prefixes admitted while others
are still prefilling in chunks of random size, decode steps, frees, preemptions on a small pool)
drive both managers, and every admission's hit and the blocks in use after every step are
compared.

    $VENV/bin/python benches/vllm_chunked_prefix.py [--schedules 200] [--steps 300] [--seed 0]

``$VENV`` is the peer venv (vLLM 0.33's block manager on a CPU torch; see benches/README.md and
the peer harness's setup script), with pagedkv importable (``PYTHONPATH=python`` and the built
extension in ``python/pagedkv``). This module imports without vLLM: only ``VllmSide`` needs it,
so ``tests/vllm/test_vllm_differential.py`` can import it anywhere (it runs in the test
command's vLLM stage).

One concept per file, beside this script: ``vllm_diff_config.py`` (a schedule family's
parameters, a schedule's counts), ``vllm_diff_pagedkv_side.py`` and ``vllm_diff_vllm_side.py``
(each manager behind the calls a schedule makes), ``vllm_diff_schedule.py`` (one schedule,
driven through both and compared after every step); this script holds the configurations and
the command line's report.

The machinery here also drives hybrid managers (``Config.windows``: a full-attention group and
sliding-window groups on one pool); ``benches/vllm_hybrid_differential.py`` runs those
configurations and documents what is compared there.

Both managers allocate per scheduled chunk, as vLLM's scheduler drives its own (pagedkv's
contract: docs/embedding.md, Per-chunk allocation):
- admission: pagedkv ``add_sequence(rid, prompt, num_scheduled=k, reserve_prompt=False)``,
  vLLM ``get_computed_blocks`` + ``allocate_slots(req, k, hit, blocks,
  full_sequence_must_fit=True)`` (the whole-prompt admission check, with ``watermark_blocks``);
- each later chunk or decode step: ``allocate_slots`` on both sides, drafts counted in the new
  tokens and ``Config.lookahead`` slots beyond them; a refusal (pagedkv ``False``, vLLM
  ``None``) is the preemption signal, and the request is freed on both sides (the released
  positions of the refused call are compared first: both release out-of-window blocks before
  sizing the allocation, and keep them released);
- ids: synchronous decode knows the sampled id when it schedules it (pagedkv gets it through
  ``provide_token_ids`` right after ``allocate_slots``); ``Config.async_ids`` gives each id a
  step late, after the next step's allocation (one token in flight: window releases run at
  ``computed - in_flight``; vLLM's ``cache_blocks`` on what is processed);
- speculative drafts (``Config.max_drafts``): accepted left to right with probability 1/2, the
  rejected ones rolled back by the watermark alone (vLLM lowers ``num_computed_tokens``;
  pagedkv ``provide_token_ids(..., num_computed_tokens=)`` with the accepted ids).

What is compared, per admission:
- pagedkv's ``match_prefix(prompt)`` (before admission), the hit ``add_sequence`` returns, and
  vLLM's ``get_computed_blocks`` hit on the same state: all three equal;
- an oracle independent of both managers: the hit covers only full blocks some request had
  scheduled (computed) by then, i.e. no admission hits a block whose K/V do not exist;
- whether the admission fits the pool (pagedkv ``OutOfBlocksError`` against vLLM's
  ``allocate_slots`` returning ``None``);
per chunk and decode step, whether it fits on both sides; and after every step: blocks in use
(in all and per group), every running request's table length, released (out-of-window)
positions and ``num_computed_tokens``.

The moment a chunk becomes hittable is the same on both sides: vLLM caches a chunk's full
blocks in ``allocate_slots`` (when the chunk is scheduled) as far as the ids are known, pagedkv
in ``add_sequence`` / ``allocate_slots`` / ``provide_token_ids`` under the same rule.

The explained divergence: vLLM's index keeps every copy of one content, pagedkv's one
(docs/conformance.md, Duplicate copies). From the step where vLLM indexes a second copy the
pools may differ block for block, so a difference from there stops the schedule and is reported
as explained; the copy-choice cases detected at an admission stop it too. Any difference before
is a mismatch.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pagedkv

# The machinery lives beside this script (one concept per file); a test that loads the script by
# path finds it there too.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_diff_config import Config, Outcome, Windows  # noqa: E402
from vllm_diff_pagedkv_side import PagedkvSide  # noqa: E402
from vllm_diff_schedule import run_schedule  # noqa: E402
from vllm_diff_vllm_side import VllmSide  # noqa: E402

__all__ = ["CONFIGS", "Config", "Outcome", "PagedkvSide", "VllmSide", "Windows", "main", "run_schedule"]


CONFIGS = {
    "small-pool": Config(),
    "tiny-pool": Config(num_blocks=24, prefix_tokens=30, max_suffix=16),
    "block16": Config(num_blocks=40, block_size=16, prefix_tokens=160, max_suffix=80, vocab=50),
    # no eviction: only the per-chunk growth and the hits are exercised
    "large-pool": Config(num_blocks=4096, steps=150),
    "watermark": Config(num_blocks=32, watermark_blocks=3),
    "async": Config(async_ids=True),
    # n-gram-style drafts scheduled as new tokens, and EAGLE-style lookahead slots beyond them
    "spec": Config(max_drafts=3),
    "spec-lookahead": Config(max_drafts=2, lookahead=2),
}


def main(argv: list[str] | None = None, configs: dict[str, Config] | None = None, doc: str = __doc__) -> int:
    """Runs ``--schedules`` schedules of each configuration (``configs``: this module's
    ``CONFIGS`` unless a caller passes its own) and prints the counts; exit 1 on a mismatch."""
    configs = CONFIGS if configs is None else configs
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--schedules", type=int, default=100, help="schedules per config")
    ap.add_argument("--steps", type=int, default=None, help="override steps per schedule")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", default=",".join(configs))
    args = ap.parse_args(argv)
    import vllm

    print(f"pagedkv {pagedkv.__version__}, vLLM {vllm.__version__}")
    total_mismatches = 0
    for name in args.configs.split(","):
        cfg = configs[name]
        if args.steps is not None:
            cfg = Config(**{**cfg.__dict__, "steps": args.steps})
        agg = Outcome()
        diverged: list[str] = []
        to_the_end = 0
        t0 = time.perf_counter()
        for i in range(args.schedules):
            o = run_schedule(args.seed + i, cfg)
            agg.admissions += o.admissions
            agg.hits += o.hits
            agg.hit_tokens += o.hit_tokens
            agg.ooms += o.ooms
            agg.preemptions += o.preemptions
            agg.drafts += o.drafts
            agg.rejected += o.rejected
            agg.async_ids += o.async_ids
            agg.steps += o.steps
            agg.released_positions += o.released_positions
            agg.mismatches += o.mismatches
            if o.diverged:
                diverged.append(o.diverged)
            to_the_end += o.steps == cfg.steps and not o.diverged
        total_mismatches += len(agg.mismatches)
        print(
            f"{name}: {args.schedules} schedules, {agg.steps} steps, {agg.admissions} "
            f"admissions ({agg.hits} with a hit, {agg.hit_tokens} hit tokens), {agg.ooms} "
            f"refused for lack of blocks, {agg.preemptions} preemptions, "
            f"{len(agg.mismatches)} mismatches, {len(diverged)} schedules stopped at a "
            f"copy-choice divergence, {to_the_end} ran all {cfg.steps} steps "
            f"({time.perf_counter() - t0:.1f} s)"
        )
        if cfg.max_drafts or cfg.async_ids:
            print(
                f"   {agg.drafts} draft tokens scheduled ({agg.rejected} rejected, rolled back), "
                f"{cfg.lookahead} lookahead slots per decode step, {agg.async_ids} ids given a step late"
            )
        if cfg.windows:
            print(
                f"   groups {cfg.windows} (None: full attention), block {cfg.block_size}: "
                f"{agg.released_positions} out-of-window positions compared (summed over steps)"
            )
        kinds = {
            "held/evictable copy": sum("requests sharing it" in d for d in diverged),
            "fit differs": sum("fits pagedkv" in d for d in diverged),
            "two evictable copies": sum("two cached-evictable" in d for d in diverged),
            "after duplicate copies": sum("two copies of one" in d for d in diverged),
        }
        steps_to_stop = sorted(int(d.split(" step ")[1].split(":")[0]) for d in diverged)
        if diverged:
            print(f"   stops by kind {kinds}; median step of a stop {steps_to_stop[len(steps_to_stop) // 2]}")
        for d in diverged[:3]:
            print("   stopped:", d)
        for m in agg.mismatches[:20]:
            print("  ", m)
    return 1 if total_mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
