"""The engine with offload tiers: ``EngineConfig(num_offload_blocks=N)`` (host tier) and
``EngineConfig(offload=store)`` (a ``pagedkv.offload`` store below it). Greedy tokens with
offload on equal offload off under pools small enough to evict; prefixes come back from the
host tier and from a store another engine (another process, for Redis) wrote; and every store
failure is a miss, never wrong tokens or an error in the step."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("xxhash", reason="pagedkv.offload needs the offload extra (xxhash)")

from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from pagedkv.errors import InvalidArgumentError, InvalidArgumentTypeError  # noqa: E402
from pagedkv.offload import DiskStore  # noqa: E402

ENGINE_TESTS = Path(__file__).resolve().parents[1] / "engine"
sys.path.insert(0, str(ENGINE_TESTS))
from tiny_llama import tiny_model  # noqa: E402

BS = 4
PREFIX = [(7 * i + 3) % 90 + 1 for i in range(24)]  # 6 full blocks
FILLERS = [[(11 * i + j) % 90 + 1 for i in range(30)] for j in range(1, 4)]


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


def _engine(model, **options) -> LLMEngine:
    options.setdefault("num_blocks", 14)
    return LLMEngine(model, EngineConfig(block_size=BS, max_num_batched_tokens=64, **options))


def _run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int = 5):
    """One request at a time (each finishes before the next arrives): (tokens, cached) each."""
    out = []
    for prompt in prompts:
        rid = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens))
        while engine.has_unfinished():
            engine.step()
        result = engine.output(rid)
        assert result.error is None, result.error
        out.append((result.outputs[0].token_ids, result.num_cached_tokens))
    return out


# The workload: the prefix, fillers that evict it from the tiny pool, the prefix again.
WORKLOAD = [PREFIX + [5], *FILLERS, PREFIX + [9, 9]]


def _reference(model):
    return [tokens for tokens, _ in _run(_engine(model, enable_prefix_caching=False), WORKLOAD)]


def test_host_tier_serves_the_evicted_prefix_with_the_same_tokens(tiny):
    reference = _reference(tiny)
    off = _run(_engine(tiny), WORKLOAD)
    engine = _engine(tiny, num_offload_blocks=32)
    on = _run(engine, WORKLOAD)
    assert [t for t, _ in on] == [t for t, _ in off] == reference
    assert off[-1][1] < len(PREFIX), "the pool kept the prefix: the test would not evict"
    assert on[-1][1] == len(PREFIX)  # every prefix block served (device or host)
    assert engine.kv.stats()["blocks_loaded"] > 0
    engine.kv.check_invariants()


def test_a_store_written_by_one_engine_serves_another(tiny, tmp_path):
    reference = _reference(tiny)
    store = DiskStore(tmp_path / "kv", capacity_bytes=1 << 24)
    writer = _engine(tiny, offload=store, offload_deadline_s=5.0)
    assert [t for t, _ in _run(writer, WORKLOAD)] == reference
    assert writer.close()
    assert store.usage_bytes > 0
    reader = _engine(tiny, offload=store, offload_deadline_s=5.0)
    (tokens, cached), *_ = _run(reader, [WORKLOAD[-1]])
    assert tokens == reference[-1]
    assert cached == len(PREFIX)
    assert reader.stats.store_hit_tokens == len(PREFIX)
    reader.close()


def _corrupt_every_entry(directory: Path, how: str) -> int:
    files = sorted(directory.glob("*.blk"))
    for f in files:
        data = f.read_bytes()
        if how == "flip":
            f.write_bytes(data[:-7] + bytes([data[-7] ^ 0x40]) + data[-6:])
        else:  # a writer killed half way: the file ends early
            f.write_bytes(data[: len(data) // 2])
    return len(files)


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_a_damaged_store_is_a_miss(tiny, tmp_path, how):
    reference = _reference(tiny)
    store = DiskStore(tmp_path / "kv", capacity_bytes=1 << 24)
    writer = _engine(tiny, offload=store)
    _run(writer, WORKLOAD)
    assert writer.close()
    assert _corrupt_every_entry(tmp_path / "kv", how) > 0
    reader = _engine(tiny, offload=DiskStore(tmp_path / "kv", capacity_bytes=1 << 24), offload_deadline_s=5.0)
    (tokens, cached), *_ = _run(reader, [WORKLOAD[-1]])
    assert tokens == reference[-1]
    assert cached == 0
    assert reader.stats.store_hit_tokens == 0


def test_a_full_disk_is_a_miss(tiny, tmp_path):
    reference = _reference(tiny)
    store = DiskStore(tmp_path / "kv", capacity_bytes=100)  # smaller than any block
    engine = _engine(tiny, offload=store, num_offload_blocks=1)
    assert [t for t, _ in _run(engine, WORKLOAD)] == reference
    assert engine.close()
    assert store.usage_bytes == 0
    assert store.stats.failed_puts > 0


@pytest.mark.parametrize(
    "options",
    [
        {"offload": object()},
        {"offload": "redis://x"},
        {"num_offload_blocks": -1},
        {"num_offload_blocks": 1.5},
        {"offload_deadline_s": float("nan")},
        {"offload_deadline_s": -1},
        {"num_offload_blocks": 4, "enable_prefix_caching": False},
    ],
)
def test_hostile_offload_options_are_typed_errors(options):
    with pytest.raises((InvalidArgumentError, InvalidArgumentTypeError)):
        EngineConfig(**options)


# ---- Redis: another process, a dead server -------------------------------------------------

_WRITER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {engine_tests!r})
    from tiny_llama import tiny_model
    from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
    from pagedkv.offload import RedisStore

    engine = LLMEngine(tiny_model(), EngineConfig(
        num_blocks=14, block_size={bs}, max_num_batched_tokens=64, offload=RedisStore({url!r})))
    for prompt in {prompts!r}:
        engine.add_request(prompt, SamplingParams(max_tokens=5))
        while engine.has_unfinished():
            engine.step()
    assert engine.close(timeout_s=30.0)
    print("stored", engine.runner.tiers.puts_submitted)
    """
)


def test_engine_b_hits_the_prefix_engine_a_computed_in_another_process(tiny, redis_server):
    from pagedkv.offload import RedisStore

    script = _WRITER.format(
        engine_tests=str(ENGINE_TESTS), bs=BS, url=redis_server.url, prompts=WORKLOAD[:-1]
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) > 0
    reference = _reference(tiny)
    engine = _engine(tiny, offload=RedisStore(redis_server.url), offload_deadline_s=5.0)
    (tokens, cached), *_ = _run(engine, [WORKLOAD[-1]])
    assert tokens == reference[-1]
    assert cached == len(PREFIX)
    engine.close()


def test_a_dead_or_restarted_redis_is_a_miss(tiny, redis_server):
    from pagedkv.offload import RedisStore

    reference = _reference(tiny)
    writer = _engine(tiny, offload=RedisStore(redis_server.url, timeout_s=0.5))
    _run(writer, WORKLOAD[:-1])
    assert writer.close(timeout_s=30.0)
    redis_server.kill()
    reader = _engine(tiny, offload=RedisStore(redis_server.url, timeout_s=0.2), offload_deadline_s=2.0)
    (tokens, cached), *_ = _run(reader, [WORKLOAD[-1]])  # the server is down: misses
    assert tokens == reference[-1] and cached == 0
    reader.close()
    redis_server.start()  # back, empty: misses again, and writes work again
    engine = _engine(tiny, offload=RedisStore(redis_server.url, timeout_s=0.5), offload_deadline_s=2.0)
    assert [t for t, _ in _run(engine, WORKLOAD)] == reference
    assert engine.close(timeout_s=30.0)


# ---- the real model ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm():
    pytest.importorskip("gguf")
    pytest.importorskip("tokenizers")
    from pagedkv.models import ModelLoadError, load_model

    try:
        return load_model()
    except ModelLoadError as error:
        pytest.skip(f"default model not installed: {error}")


def test_smollm2_llm_with_a_store_equals_no_offload(smollm, tmp_path):
    """``LLM(offload=store)``: each ``generate`` runs a fresh engine, so the second call's hit
    can only come from the store the first one wrote through (its prompt was evicted by the
    next one in a 3-block pool)."""
    from pagedkv.engine import LLM

    prompt = list(range(1000, 1040))  # 40 tokens: 2 full blocks of 16 before the last token
    other = list(range(2000, 2040))
    options = {"num_blocks": 3, "max_num_seqs": 1}
    params = SamplingParams(max_tokens=3)
    plain = LLM(smollm, enable_prefix_caching=False, **options)
    want = [out.outputs[0].token_ids for out in plain.generate([prompt, other], params)]
    llm = LLM(
        smollm, offload=DiskStore(tmp_path / "kv", capacity_bytes=1 << 26), offload_deadline_s=10.0, **options
    )
    first = llm.generate([prompt, other], params)
    assert [out.outputs[0].token_ids for out in first] == want
    (again,) = llm.generate([prompt], params)
    assert again.outputs[0].token_ids == want[0]
    assert again.num_cached_tokens == 32
    assert llm.last_engine.stats.store_hit_tokens == 32


def test_waiting_prompts_are_prefetched_from_the_store(tiny, tmp_path):
    """Two requests queued at once in a one-sequence engine: the second's store blocks are
    prefetched while the first runs, and its admission takes them from the prefetch."""
    reference = _reference(tiny)
    store = DiskStore(tmp_path / "kv", capacity_bytes=1 << 24)
    writer = _engine(tiny, offload=store)
    _run(writer, WORKLOAD)
    assert writer.close()
    reader = _engine(tiny, offload=store, offload_deadline_s=5.0, max_num_seqs=1)
    ids = [reader.add_request(p, SamplingParams(max_tokens=5)) for p in (FILLERS[0], WORKLOAD[-1])]
    while reader.has_unfinished():
        reader.step()
    out = [reader.output(i) for i in ids]
    assert out[1].outputs[0].token_ids == reference[-1]
    assert out[1].num_cached_tokens == len(PREFIX)
    assert reader.runner.tiers is not None
    assert reader.runner.tiers.prefetched_blocks == len(PREFIX) // BS
    reader.close()


def test_random_schedules_with_offload_tiers_equal_each_request_alone(tiny, tmp_path):
    """The engine's randomized schedules (tests/engine/test_engine_randomized.py: preemption by
    recompute and swap, chunked prefill, n > 1, speculation, tiny pools) with a host offload
    tier, and in every other trial a DiskStore, where the trial runs a second time on a fresh
    engine (which hits the blocks the first run wrote through): every request's tokens equal
    running it alone."""
    import dataclasses

    import numpy as np
    from test_engine_randomized import MAX_STEPS, _alone, _random_trial

    rng = np.random.default_rng(33)
    alone: dict = {}
    loaded = store_hits = 0
    for trial in range(60):
        config, requests = _random_trial(rng, tiny, alone)
        with_store = trial % 2 == 1
        config = dataclasses.replace(
            config,
            enable_prefix_caching=True,
            num_offload_blocks=int(rng.integers(1, 2 * config.num_blocks)),
            offload=DiskStore(tmp_path / f"kv{trial}", capacity_bytes=1 << 22) if with_store else None,
            offload_deadline_s=5.0,
        )
        for _ in range(2 if with_store else 1):
            engine = LLMEngine(tiny, config)
            ids: dict[int, int] = {}
            step = 0
            while len(ids) < len(requests) or engine.has_unfinished():
                for i, (arrival, prompt, params) in enumerate(requests):
                    if arrival == step:
                        ids[i] = engine.add_request(prompt, params)
                engine.step()
                engine.kv.check_invariants()
                step += 1
                assert step < MAX_STEPS, f"no progress: {config}"
            assert engine.close()
            for i, (_, prompt, params) in enumerate(requests):
                got = [c.token_ids for c in engine.output(ids[i]).outputs]
                assert got == [_alone(tiny, prompt, params, alone, k) for k in range(params.n)], (
                    trial,
                    config,
                    i,
                )
            loaded += engine.kv.stats()["blocks_loaded"]
            store_hits += engine.stats.store_hit_tokens
    assert loaded > 0 and store_hits > 0, (loaded, store_hits)


def test_the_engine_refuses_offload_on_a_hybrid_layout():
    from tiny_hybrid import tiny_hybrid_model  # tests/engine, on the path above

    model = tiny_hybrid_model()
    with pytest.raises(InvalidArgumentError, match="hybrid_kv=False"):
        LLMEngine(model, EngineConfig(num_blocks=32, block_size=4, num_offload_blocks=8))
    engine = LLMEngine(
        model, EngineConfig(num_blocks=32, block_size=4, num_offload_blocks=8, hybrid_kv=False)
    )
    assert engine.kv.num_offload_blocks == 8
