"""The plain-Python benchmark baseline is a correct block manager: the same random operations
give it and KvCacheManager the same block counts, token counts, copies and errors."""

from __future__ import annotations

import random

import pagedkv
import pytest
from baseline_manager import BaselineBlockManager
from pagedkv import OutOfBlocksError, PagedKvError


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_baseline_matches_manager(seed: int, prefix_caching: bool) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 16])
    num_blocks = 64
    kv = pagedkv.KvCacheManager(
        num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=prefix_caching
    )
    base = BaselineBlockManager(
        num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=prefix_caching
    )
    prompts = [[rng.randrange(3) for _ in range(rng.randrange(1, 120))] for _ in range(4)]
    live: list[int] = []
    for step in range(400):
        op = rng.random()
        calls = []
        if op < 0.3 or not live:
            prompt = rng.choice(prompts)[: rng.randrange(1, 121)]
            prompt = prompt + [rng.randrange(3) for _ in range(rng.randrange(4))]
            with_ids = rng.random() < 0.8
            kwargs = {"token_ids": prompt} if with_ids else {"num_tokens": len(prompt)}
            calls = [(m.add_sequence, (step,), kwargs) for m in (kv, base)]
            new = step
        elif op < 0.55:
            seq_id = rng.choice(live)
            tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 20))]
            calls = [(m.append_tokens, (seq_id, tokens), {}) for m in (kv, base)]
            new = None
        elif op < 0.65:
            seqs = rng.sample(live, min(len(live), 3))
            calls = [(m.append_tokens_batch, (seqs,), {"num_tokens": 2}) for m in (kv, base)]
            new = None
        elif op < 0.8:
            parent = rng.choice(live)
            calls = [(m.fork, (parent, step), {}) for m in (kv, base)]
            new = step
        else:
            seq_id = live.pop(rng.randrange(len(live)))
            calls = [(m.free, (seq_id,), {}) for m in (kv, base)]
            new = None
        outcomes = []
        for fn, args, kwargs in calls:
            try:
                outcomes.append(("ok", fn(*args, **kwargs)))
            except PagedKvError as err:
                outcomes.append((type(err).__name__, None))
        if prefix_caching and outcomes[0][0] != outcomes[1][0]:
            # With caching, eviction choices may differ only in which blocks, never in how
            # many: a divergence would show in the counts below, so treat it as a failure.
            pytest.fail(f"step {step}: {outcomes}")
        assert outcomes[0] == outcomes[1], (step, outcomes)
        if outcomes[0][0] == "ok" and new is not None:
            live.append(new)
        assert kv.num_free_blocks == base.num_free_blocks, step
        assert kv.stats()["num_blocks_in_use"] == base.num_blocks_in_use, step
        assert len(kv.take_copy_ops()) == len(base.take_copy_ops()), step
        for seq_id in live:
            assert kv.num_tokens(seq_id) == base.num_tokens(seq_id)
            assert len(kv.block_table(seq_id)) == len(base.block_table(seq_id))
        base.check_invariants()
    kv.check_invariants()
    if prefix_caching:
        assert kv.stats()["prefix_hit_tokens"] == base.prefix_hit_tokens
        assert kv.stats()["evictions"] == base.evictions


def test_baseline_parallel_sampling_uses_114_blocks() -> None:
    base = BaselineBlockManager(num_blocks=512, block_size=16)
    base.add_sequence(0, list(range(1000)))
    for child in (1, 2, 3):
        base.fork(0, child)
    for _ in range(200):
        base.append_tokens_batch([0, 1, 2, 3])
    assert base.num_blocks_in_use == 114
    base.check_invariants()


def test_baseline_errors() -> None:
    base = BaselineBlockManager(num_blocks=4, block_size=4)
    base.add_sequence(1, num_tokens=12)
    with pytest.raises(OutOfBlocksError):
        base.add_sequence(2, num_tokens=8)
    with pytest.raises(pagedkv.InvalidArgumentError):
        base.add_sequence(2, num_tokens=17)
    with pytest.raises(pagedkv.SequenceExistsError):
        base.fork(1, 1)
    with pytest.raises(pagedkv.UnknownSequenceError):
        base.free(5)
    base.check_invariants()
