"""Prefix-cached admission: admitting a 2,000-token prompt whose first 1,024 tokens are cached (hash +
lookup + allocate + insert) through Python, in prompt tokens per second, against the plain-
Python baseline extended with a dict-of-hashes prefix cache. Target: >= 10 M tokens/s."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from bench_helpers import make_manager

PROMPT_TOKENS = 2000
CACHED_TOKENS = 1024
BLOCK_SIZE = 16


@pytest.mark.parametrize("as_array", [False, True], ids=["list", "ndarray"])
def test_admit_prompt_with_cached_prefix(benchmark: Any, record: Any, impl: str, as_array: bool) -> None:
    if impl == "baseline" and as_array:
        pytest.skip("the baseline takes lists")
    rng = random.Random(0)
    kv = make_manager(impl, num_blocks=4096, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    prefix = [rng.randrange(32000) for _ in range(CACHED_TOKENS)]
    kv.add_sequence(0, prefix)  # stays live: its 64 full blocks are the cached prefix
    next_id = iter(range(1, 10**9))
    previous: list[int] = []

    def setup() -> tuple[tuple[int, Any], dict[str, Any]]:
        # Free the last admitted prompt (its unique blocks become cached-evictable, so the
        # pool fills up and later admissions also evict) and draw a fresh unique suffix.
        if previous:
            kv.free(previous.pop())
        suffix = [rng.randrange(32000) for _ in range(PROMPT_TOKENS - CACHED_TOKENS)]
        prompt: Any = prefix + suffix
        if as_array:
            prompt = np.array(prompt, dtype=np.int64)
        seq_id = next(next_id)
        previous.append(seq_id)
        return (seq_id, prompt), {}

    hits = benchmark.pedantic(kv.add_sequence, setup=setup, rounds=600, warmup_rounds=20)
    assert hits == CACHED_TOKENS
    label = "ndarray" if as_array else "list"
    record(f"admit 2000-token prompt, 1024 cached ({label})", impl, PROMPT_TOKENS, "token")
