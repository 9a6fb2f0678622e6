"""The scheduler plans, the model runner moves data (docs/engine.md, "One step").

Under swap preemption, a host cache that evicts and loads, and a store (every kind of data
move a step can make): each step's ``ScheduledBatch`` carries its moves in the documented
order, and at no step does the scheduler hold a K/V array or anything that holds one. (The
import direction is checked in tests/python/test_layering.py; the tokens, against runs without
these tiers, in tests/offload/test_engine_offload.py and test_engine_randomized.py.)"""

from __future__ import annotations

import gc
import sys
import types

import numpy as np
import pytest

pytest.importorskip("xxhash", reason="the store needs the offload extra (xxhash)")

PREFIX = [(7 * i + 3) % 90 + 1 for i in range(24)]
PROMPTS = [PREFIX + [5], *[[(11 * i + j) % 90 + 1 for i in range(30)] for j in range(1, 4)], PREFIX + [9, 9]]
REPETITIVE = [[7, 8, 9, 10, 11] * 4 + [7], [3, 4, 5] * 5, [20, 21, 22, 23, 24, 25] * 3]


def _engine(tiny, tmp_path, **options):
    from pagedkv.engine import EngineConfig, LLMEngine
    from pagedkv.offload import DiskStore

    store = DiskStore(tmp_path / "kv", capacity_bytes=1 << 24)
    config = EngineConfig(
        num_blocks=24,
        block_size=4,
        max_num_batched_tokens=32,
        num_host_blocks=40,
        preemption="swap",
        num_host_cache_blocks=32,
        offload=store,
        offload_deadline_s=5.0,
        **options,
    )
    return LLMEngine(tiny, config)


def _kv_holders(engine) -> tuple[list[np.ndarray], tuple[type, ...]]:
    """The runner's K/V arrays, and the types that hold or move them."""
    from pagedkv.attention import QuantizedKvCache
    from pagedkv.engine.host_cache import HostCache
    from pagedkv.engine.kv_store import PagedKvStore
    from pagedkv.engine.model_runner import ModelRunner
    from pagedkv.engine.store_saves import StoreSaves

    store, cache = engine.runner.store, engine.runner.host_cache
    caches = [*store.k_caches, *store.v_caches, *store.host_k, *store.host_v]
    caches += [*cache.host_k, *cache.host_v]
    arrays = []
    for c in caches:  # a quantized cache's blocks and residual slots
        arrays += (
            [c.data, *([] if c.residual is None else [c.residual.data])]
            if isinstance(c, QuantizedKvCache)
            else [c]
        )
    return arrays, (PagedKvStore, HostCache, StoreSaves, ModelRunner, QuantizedKvCache)


def _reachable(root: object, stop: tuple[type, ...]) -> list[object]:
    """Every object reachable from ``root``, not looking inside ``stop`` instances (the block
    manager, the sequences, the store worker: none of them holds the runner's arrays)."""
    seen: dict[int, object] = {}
    todo = [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, types.FunctionType)):
            continue
        seen[id(obj)] = obj
        if obj is not root and isinstance(obj, stop):
            continue
        todo.extend(gc.get_referents(obj))
    return list(seen.values())


def _check_scheduler_holds_no_kv(engine) -> None:
    import pagedkv
    from pagedkv.engine.sequence import Request, Sequence
    from pagedkv.offload import BlockStore, OffloadWorker

    arrays, holders = _kv_holders(engine)
    stop = (pagedkv.KvCacheManager, Sequence, Request, OffloadWorker, BlockStore, np.random.Generator)
    for obj in _reachable(engine.scheduler, stop):
        assert not isinstance(obj, holders), type(obj).__name__
        if isinstance(obj, np.ndarray):
            assert not any(np.shares_memory(obj, a) for a in arrays), obj.shape


def _order(op) -> int:
    from pagedkv.engine import scheduled_batch as sb

    # The residual moves decided between steps come first; swaps and the offloads before each
    # swap-in come as decided, then the step's last offloads; copies, loads and store hits
    # follow every offload.
    order = {sb.CopyResidual: -1, sb.ReopenBlock: -1, sb.SwapIn: 0, sb.SwapOut: 0, sb.Offload: 0}
    return {**order, sb.CopyBlocks: 1, sb.Load: 2, sb.StoreHits: 3}[type(op)]


@pytest.mark.parametrize("kv_cache_dtype", [None, "int4"])
def test_each_step_plans_its_moves_in_order_and_the_scheduler_holds_no_kv(tiny, tmp_path, kv_cache_dtype):
    from pagedkv.engine import SamplingParams

    int4 = kv_cache_dtype == "int4"
    options = {"kv_cache_dtype": kv_cache_dtype, "speculative_ngram": 4} if int4 else {}
    seen_ops: set[str] = set()
    for policy in ("compute", "evict"):
        for round_ in range(2):  # the second engine hits the store the first one filled
            engine = _engine(tiny, tmp_path / str(kv_cache_dtype), offload_policy=policy, **options)
            schedule = engine.scheduler.schedule
            batches = []

            def recording(schedule=schedule, batches=batches):
                batch = schedule()
                batches.append(batch)
                return batch

            engine.scheduler.schedule = recording
            # int4: greedy repetitive prompts draft (rejected drafts reopen blocks), sampled
            # requests fork.
            prompts = PROMPTS + (REPETITIVE if int4 else [])
            for i, prompt in enumerate(prompts):
                temperature = 0.0 if int4 and (i % 2 == 0 or prompt in REPETITIVE) else 0.7
                params = SamplingParams(
                    max_tokens=12 if int4 else 6, n=1 + i % 2, temperature=temperature, seed=i
                )
                engine.add_request(prompt, params)
                engine.step()
                _check_scheduler_holds_no_kv(engine)
            while engine.has_unfinished():
                engine.step()
                _check_scheduler_holds_no_kv(engine)
                engine.kv.check_invariants()
            assert engine.close(timeout_s=30.0)
            for batch in batches:
                kinds = [_order(op) for op in batch.ops]
                assert kinds == sorted(kinds), [type(op).__name__ for op in batch.ops]
                assert len(batch.block_tables) == (1 if batch.rows else 0)
                if batch.save is not None:
                    assert policy == "compute" and len(batch.save.blocks) == len(batch.save.hashes)
                seen_ops.update(type(op).__name__ for op in batch.ops)
                if batch.save is not None:
                    seen_ops.add("SaveComputed")
            del round_
    # The schedules reached every kind of move.
    expected = {"SwapOut", "SwapIn", "Offload", "CopyBlocks", "Load", "StoreHits", "SaveComputed"}
    assert seen_ops == (expected | {"CopyResidual", "ReopenBlock"} if int4 else expected), seen_ops


def test_the_runner_executes_a_plan_without_the_scheduler(tiny):
    """A hand-made plan: a copy-on-write copy before the pass, and the pass's logits for the
    sampling row (the runner needs no scheduler and no block manager)."""
    from pagedkv.engine import EngineConfig, SamplingParams
    from pagedkv.engine.model_runner import ModelRunner
    from pagedkv.engine.scheduled_batch import CopyBlocks, Row, ScheduledBatch
    from pagedkv.engine.sequence import Request, Sequence

    runner = ModelRunner(tiny, EngineConfig(num_blocks=8, block_size=4))
    store = runner.store
    rng = np.random.default_rng(0)
    for cache in (*store.k_caches, *store.v_caches):
        cache[2] = rng.standard_normal(cache[2].shape, dtype=np.float32)
    request = Request(0, [1, 2, 3], SamplingParams(max_tokens=1), 0.0)
    seq = Sequence(0, request, 0, [1, 2, 3], rng)
    table = np.array([[0]], np.int32)
    batch = ScheduledBatch([Row(seq, 0, 3)], [table], [CopyBlocks(np.array([[2, 5]], np.int32))])
    out = runner.execute(batch)
    assert [row.seq for row, _ in out] == [seq] and out[0][1].shape == (1, tiny.config.vocab_size)
    for cache in (*store.k_caches, *store.v_caches):
        assert np.array_equal(cache[5], cache[2])  # the copy ran
        assert np.any(cache[0][:3] != 0)  # the pass wrote its rows' K/V


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
