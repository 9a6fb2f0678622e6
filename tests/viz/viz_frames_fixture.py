"""A small recording in the ``record_frames`` schema (SIM_API.md), built without the simulator.

Used only to test the encoder and the page format in isolation; the browser test and the
recorder test use frames from the real simulator.
"""

from __future__ import annotations

import math
import random
from typing import Any


def fixture_recording(
    *, block_size: int = 4, num_slots: int = 64, num_steps: int = 24, seed: int = 0, max_running: int = 4
) -> dict[str, Any]:
    """Requests admitted while blocks last, one token per step each, blocks drawn from a
    shuffled free list (so tables are scattered), a request preempted when no block is left."""
    rng = random.Random(seed)
    num_blocks = num_slots // block_size
    free = list(range(num_blocks))
    rng.shuffle(free)
    running: dict[int, list[Any]] = {}  # rid -> [num_tokens, blocks, final_tokens]
    waiting = list(range(10))
    finished = preemptions = 0
    frames = []
    for step in range(num_steps):
        while waiting and len(running) < max_running:
            prompt = rng.randint(1, 3 * block_size)
            need = math.ceil(prompt / block_size)
            if need > len(free):
                break
            rid = waiting.pop(0)
            running[rid] = [prompt, [free.pop() for _ in range(need)], prompt + rng.randint(1, 12)]
        for rid in sorted(running):
            entry = running[rid]
            entry[0] += 1
            if math.ceil(entry[0] / block_size) > len(entry[1]):
                if not free:
                    free.extend(entry[1])
                    del running[rid]
                    waiting.insert(0, rid)
                    preemptions += 1
                    continue
                entry[1].append(free.pop())
            if entry[0] >= entry[2]:
                free.extend(entry[1])
                del running[rid]
                finished += 1
        pool = [[-1, 0, 0] for _ in range(num_blocks)]
        for rid, (num_tokens, blocks, _) in running.items():
            for i, block in enumerate(blocks):
                held = min(block_size, num_tokens - i * block_size)
                pool[block] = [rid, held, block_size - held]
        used = num_blocks - len(free)
        tokens = sum(entry[0] for entry in running.values())
        frag = used * block_size - tokens
        frames.append(
            {
                "step": step,
                "running": len(running),
                "waiting": len(waiting),
                "finished": finished,
                "preemptions": preemptions,
                "used_blocks": used,
                "token_slots": tokens,
                "reserved_slots": 0,
                "internal_frag_slots": frag,
                "waste_pct": 100.0 * frag / (used * block_size) if used else 0.0,
                "pool": pool,
                "tables": {
                    rid: {"blocks": list(blocks), "num_tokens": n} for rid, (n, blocks, _) in running.items()
                },
            }
        )
    return {
        "config": {"allocator": "paged", "block_size": block_size, "num_slots": num_slots},
        "num_blocks": num_blocks,
        "block_size": block_size,
        "frames": frames,
    }


def fixture_data(
    block_sizes=(1, 2, 4, 8), allocators=("paged", "contiguous-max"), seeds=(0, 1), num_steps: int = 24
) -> dict[str, Any]:
    """A page data dict over a grid of fixture recordings (allocator labels are cosmetic here)."""
    from pagedkv.viz.encode import encode_run

    runs = []
    for seed in seeds:
        for a_index, allocator in enumerate(allocators):
            for block_size in block_sizes:
                rec = fixture_recording(block_size=block_size, seed=seed * 7 + a_index, num_steps=num_steps)
                runs.append(encode_run(rec, allocator=allocator, block_size=block_size, seed=seed))
    return {"workload": {"name": "fixture"}, "num_slots": 64, "max_model_len": 64, "runs": runs}
