"""The engine's per-chunk admission of W2 prompts (one of 16 system prompts of 1,024 tokens plus
100-500 of its own; chunks of 512 tokens; 64 sequences resident), with or without the hashes
computed at arrival (``add_sequence(..., prompt_hashes=...)``, docs/scheduling.md, Cost). Count
its instructions with callgrind (benches/results/2026-12-06-cache-aware-scheduling-v3.md):

    valgrind --tool=callgrind --callgrind-out-file=plain.cg \
        python benches/prompt_hashes_per_chunk.py plain 300
    callgrind_annotate --inclusive=yes --threshold=100 plain.cg | grep -E 'add_sequence_with|ChainHasher'
"""

import sys

import numpy as np
from pagedkv import KvCacheManager


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "hashed"  # "plain" | "hashed"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    rng = np.random.default_rng(44)
    kv = KvCacheManager(num_blocks=65536, block_size=16, enable_prefix_caching=True)
    resident: list[int] = []
    for i in range(n):
        system = int(rng.integers(16))
        suffix = 100 + int(rng.integers(401))
        prompt = np.concatenate(
            [2_000_000_000 + system * 1024 + np.arange(1024), i * 512 + np.arange(suffix)]
        ).astype(np.int64)
        held = kv.prompt_hashes(prompt)  # computed at arrival for the queue either way
        hit = kv.match_prefix(prompt)
        chunk = min(512, len(prompt) - hit)
        if mode == "hashed":
            kv.add_sequence(i, prompt, num_scheduled=chunk, reserve_prompt=False, prompt_hashes=held)
        else:
            kv.add_sequence(i, prompt, num_scheduled=chunk, reserve_prompt=False)
        while kv.num_computed_tokens(i) < len(prompt):
            kv.allocate_slots(i, min(512, len(prompt) - kv.num_computed_tokens(i)))
        resident.append(i)
        if len(resident) > 64:
            kv.free(resident.pop(0))


if __name__ == "__main__":
    main()
