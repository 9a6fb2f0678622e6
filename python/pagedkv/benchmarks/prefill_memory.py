"""KV memory *during* a chunked prefill, step by step, from the engine's own scheduler.

The engine allocates blocks per scheduled chunk (docs/engine.md, "Per-chunk allocation"): a
sliding-window group holds its window plus the chunk in flight, never the whole prompt, at
every step of the prefill and not only after it. This replays that without the model: the
engine's ``Scheduler`` over a ``KvCacheManager`` built with the engine's options
(``engine/manager_options.py``) plans each step of one request of ``context - 1`` prompt
tokens (``ScheduledBatch``), and the pass is taken as run (``computed_rows``); after the last
chunk the first sampled token is appended (the decode step at position ``context - 1``). At
each step, after the step's allocation (what the pass reads and writes), the blocks the
sequence holds in each KV group are counted from its tables (a released position is ``-1``).
The forward pass is what the replay leaves out (an 8 K-token Gemma prefill is minutes of NumPy
compute): tests/engine/test_bench_memory.py checks that the engine, run on the tiny hybrid
model, holds exactly the replay's blocks at every step.

The all-full reference is the same context in the layout with every layer in one
full-attention group (``hybrid_kv=False``): ``ceil(context / block_size)`` blocks of that
layout's bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.kv_layout import KvLayout, kv_layout, layer_windows, new_manager
from pagedkv.engine.manager_options import manager_options
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.scheduler import Scheduler
from pagedkv.engine.sequence import Request, Sequence
from pagedkv.engine.stats import EngineStats

__all__ = ["blocks_per_group", "chunked_prefill_memory"]


def blocks_per_group(kv: Any, seq_id: int, num_groups: int) -> list[int]:
    """The blocks ``seq_id`` holds in each KV group (its table's live entries)."""
    return [int((kv.block_table(seq_id, group=g) >= 0).sum()) for g in range(num_groups)]


def chunked_prefill_memory(
    config: Any, context: int, *, block_size: int = 16, chunk: int = 256
) -> dict[str, Any]:
    """One request of ``context - 1`` prompt tokens prefilled in ``chunk``-token steps by the
    engine's scheduler, then its first token decoded: ``steps[i]`` = the blocks held per KV group
    at step ``i``; ``peak_bytes`` the most bytes held at any step; ``all_full_bytes`` the
    context in the all-full layout; ``peak_ratio`` = their ratio."""
    windows = layer_windows(config)
    layout = kv_layout(windows, hybrid=True)
    full_layout = kv_layout(windows, hybrid=False)
    positions = -(-context // block_size)
    max_model_len = config.max_model_len
    engine_config = EngineConfig(
        num_blocks=layout.num_groups * positions + 1,  # never the limit: the request runs alone
        block_size=block_size,
        enable_prefix_caching=False,
        max_num_batched_tokens=chunk,
    )
    kv = new_manager(layout, **manager_options(engine_config, max_model_len))
    scheduler = Scheduler(engine_config, max_model_len, kv, layout, EngineStats())
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, config.vocab_size, size=context - 1).tolist()
    request = Request(0, prompt, SamplingParams(max_tokens=2, ignore_eos=True), 0.0)
    seq = Sequence(0, request, 0, list(prompt), rng)
    request.sequences.append(seq)
    scheduler.add(seq)
    steps: list[list[int]] = []
    rows_per_step: list[int] = []
    while True:
        batch = scheduler.schedule()
        kv.check_invariants()
        steps.append(blocks_per_group(kv, seq.seq_id, layout.num_groups))
        rows_per_step.append(sum(r.end - r.start for r in batch.rows))
        scheduler.computed_rows(batch.rows)
        if any(r.decode for r in batch.rows):
            break  # the first decode step: the context is complete
        if any(r.samples for r in batch.rows):
            # The prefill's last chunk: the pass samples the first token.
            seq.token_ids.append(1)
            seq.output_ids.append(1)
    per_block = _bytes_per_block(layout, config, block_size)
    all_full = positions * _bytes_per_block(full_layout, config, block_size)
    peak = max(sum(s) for s in steps) * per_block
    return {
        "context": context,
        "chunk": chunk,
        "kv_groups": ["full" if w is None else f"window {w}" for w in layout.group_windows],
        "bytes_per_block": per_block,
        "tokens_per_step": rows_per_step,
        "steps": steps,
        "peak_blocks": max(sum(s) for s in steps),
        "peak_bytes": peak,
        "final_bytes": sum(steps[-1]) * per_block,
        "all_full_bytes": all_full,
        "peak_ratio": peak / all_full,
    }


def _bytes_per_block(layout: KvLayout, config: Any, block_size: int) -> int:
    return layout.bytes_per_block(block_size, config.num_kv_heads, config.head_dim)
