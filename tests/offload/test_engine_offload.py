"""The engine with offload tiers: ``EngineConfig(num_host_cache_blocks=N)`` (host tier) and
``EngineConfig(offload=store)`` (a ``pagedkv.offload`` store below it). Greedy tokens with
offload on equal offload off under pools small enough to evict; prefixes come back from the
host tier and from a store another engine (another process, for Redis) wrote; and every store
failure is a miss, never wrong tokens or an error in the step."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

pytest.importorskip("xxhash", reason="pagedkv.offload needs the offload extra (xxhash)")

from listen_ports import free_port  # noqa: E402
from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from pagedkv.errors import InvalidArgumentError, InvalidArgumentTypeError  # noqa: E402
from pagedkv.offload import DiskStore  # noqa: E402

ENGINE_TESTS = Path(__file__).resolve().parents[1] / "engine"
sys.path.insert(0, str(ENGINE_TESTS))
from tiny_llama import tiny_model  # noqa: E402

BS = 4
# The deadline of a reader whose hits a test counts: a load returns as soon as the store has
# answered, so this is only a guard (the most EngineConfig takes); a tight deadline made those
# counts depend on how busy the machine was.
LOAD_GUARD_S = 60.0
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
    engine = _engine(tiny, num_host_cache_blocks=32)
    on = _run(engine, WORKLOAD)
    assert [t for t, _ in on] == [t for t, _ in off] == reference
    assert off[-1][1] < len(PREFIX), "the pool kept the prefix: the test would not evict"
    assert on[-1][1] == len(PREFIX)  # every prefix block served (device or host)
    assert engine.kv.stats()["blocks_loaded"] > 0
    engine.kv.check_invariants()


def test_a_store_written_by_one_engine_serves_another(tiny, tmp_path):
    reference = _reference(tiny)
    store = DiskStore(tmp_path / "kv", capacity_bytes=1 << 24)
    writer = _engine(tiny, offload=store, offload_deadline_s=LOAD_GUARD_S)
    assert [t for t, _ in _run(writer, WORKLOAD)] == reference
    assert writer.close()
    assert store.usage_bytes > 0
    reader = _engine(tiny, offload=store, offload_deadline_s=LOAD_GUARD_S)
    (tokens, cached), *_ = _run(reader, [WORKLOAD[-1]])
    assert tokens == reference[-1]
    assert cached == len(PREFIX)
    assert reader.stats.store_hit_tokens == len(PREFIX)
    reader.close()


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_quantized_blocks_go_through_the_host_tier_and_the_store_as_bytes(tiny, tmp_path, dtype):
    """A quantized engine's blocks (codes and scales) through the host tier and the store give
    the tokens of recomputing them; the store serves them only to an engine of the same dtype
    (its key carries the dtype and the layout identity names it)."""
    reference = [
        t for t, _ in _run(_engine(tiny, enable_prefix_caching=False, kv_cache_dtype=dtype), WORKLOAD)
    ]
    host = _engine(tiny, num_host_cache_blocks=32, kv_cache_dtype=dtype)
    on = _run(host, WORKLOAD)
    assert [t for t, _ in on] == reference and on[-1][1] == len(PREFIX)
    assert host.kv.stats()["blocks_loaded"] > 0
    store = DiskStore(tmp_path / "kv", capacity_bytes=1 << 24)
    writer = _engine(tiny, offload=store, offload_deadline_s=5.0, kv_cache_dtype=dtype)
    assert [t for t, _ in _run(writer, WORKLOAD)] == reference
    assert writer.close() and store.usage_bytes > 0
    reader = _engine(tiny, offload=store, offload_deadline_s=5.0, kv_cache_dtype=dtype)
    (tokens, cached), *_ = _run(reader, [WORKLOAD[-1]])
    assert tokens == reference[-1] and cached == len(PREFIX)
    assert reader.stats.store_hit_tokens == len(PREFIX)
    reader.close()
    for other in (None, "fp8_e4m3" if dtype == "int8" else "int8"):
        stranger = _engine(tiny, offload=store, offload_deadline_s=5.0, kv_cache_dtype=other)
        (_, cached), *_ = _run(stranger, [WORKLOAD[-1]])
        assert cached == 0 and stranger.stats.store_hit_tokens == 0
        stranger.close()


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
    reader = _engine(
        tiny, offload=DiskStore(tmp_path / "kv", capacity_bytes=1 << 24), offload_deadline_s=LOAD_GUARD_S
    )
    (tokens, cached), *_ = _run(reader, [WORKLOAD[-1]])
    assert tokens == reference[-1]
    assert cached == 0
    assert reader.stats.store_hit_tokens == 0


def test_a_full_disk_is_a_miss(tiny, tmp_path):
    reference = _reference(tiny)
    store = DiskStore(tmp_path / "kv", capacity_bytes=100)  # smaller than any block
    engine = _engine(tiny, offload=store, num_host_cache_blocks=1)
    assert [t for t, _ in _run(engine, WORKLOAD)] == reference
    assert engine.close()
    assert store.usage_bytes == 0
    assert store.stats.failed_puts > 0


@pytest.mark.parametrize(
    "options",
    [
        {"offload": object()},
        {"offload": "redis://x"},
        {"num_host_cache_blocks": -1},
        {"num_host_cache_blocks": 1.5},
        {"offload_deadline_s": float("nan")},
        {"offload_deadline_s": -1},
        {"offload_policy": "never"},
        {"offload_policy": None},
        {"offload_policy": 1},
        {"num_host_cache_blocks": 4, "enable_prefix_caching": False},
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
    from pagedkv.offload import DiskStore, RedisStore

    engine = LLMEngine(tiny_model(), EngineConfig(
        num_blocks={num_blocks}, block_size={bs}, max_num_batched_tokens=64, offload={store},
        **{options!r}))
    for prompt in {prompts!r}:
        engine.add_request(prompt, SamplingParams(max_tokens=5))
        while engine.has_unfinished():
            engine.step()
            engine.kv.check_invariants()
    assert engine.close(timeout_s=30.0)
    print("offloaded", engine.kv.stats()["blocks_offloaded"])
    print("stored", engine.runner.saves.puts_submitted)
    """
)


def _write_in_another_process(store: str, prompts, num_blocks: int = 14, **options) -> tuple[int, int]:
    """Engine A in a subprocess: (blocks its host tier took from the device, puts it queued)."""
    script = _WRITER.format(
        engine_tests=str(ENGINE_TESTS),
        bs=BS,
        store=store,
        prompts=prompts,
        num_blocks=num_blocks,
        options=options,
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    counts = dict(line.split() for line in done.stdout.splitlines())
    return int(counts["offloaded"]), int(counts["stored"])


def test_engine_b_hits_the_prefix_engine_a_computed_in_another_process(tiny, redis_server):
    from pagedkv.offload import RedisStore

    offloaded, stored = _write_in_another_process(f"RedisStore({redis_server.url!r})", WORKLOAD[:-1])
    assert offloaded > 0 and stored > 0
    reference = _reference(tiny)
    engine = _engine(tiny, offload=RedisStore(redis_server.url), offload_deadline_s=LOAD_GUARD_S)
    (tokens, cached), *_ = _run(engine, [WORKLOAD[-1]])
    assert tokens == reference[-1]
    assert cached == len(PREFIX)
    engine.close()


@pytest.mark.parametrize("kind", ["redis", "disk"])
@pytest.mark.parametrize("policy", ["compute", "evict"])
def test_a_prefix_engine_a_never_evicted_reaches_engine_b(tiny, tmp_path, request, kind, policy):
    """Engine A (another process) runs the prefix in a pool so large that nothing is evicted:
    save-on-compute (the default) still puts its blocks in the shared store, and engine B hits
    all of them with the tokens of computing them; save-on-evict leaves B nothing to hit."""
    from pagedkv.offload import RedisStore

    if kind == "redis":
        url = request.getfixturevalue("redis_server").url
        expression, reader_store = f"RedisStore({url!r})", RedisStore(url)
    else:
        path = str(tmp_path / "kv")
        expression = f"DiskStore({path!r}, capacity_bytes=1 << 24)"
        reader_store = None
    options = {} if policy == "compute" else {"offload_policy": "evict"}
    offloaded, stored = _write_in_another_process(expression, [WORKLOAD[0]], num_blocks=64, **options)
    assert offloaded == 0, "engine A evicted: the test would not show save-on-compute"
    if reader_store is None:
        reader_store = DiskStore(tmp_path / "kv", capacity_bytes=1 << 24)
    reference = _reference(tiny)
    engine = _engine(tiny, offload=reader_store, offload_deadline_s=LOAD_GUARD_S, offload_policy=policy)
    (tokens, cached), *_ = _run(engine, [WORKLOAD[-1]])
    engine.kv.check_invariants()
    assert tokens == reference[-1]
    if policy == "compute":
        # 6 prefix blocks, and the block the 5 decoded tokens filled after the prompt's 25th.
        assert stored == len(PREFIX) // BS + 1
        assert cached == len(PREFIX)
        assert engine.stats.store_hit_tokens == len(PREFIX)
    else:
        assert stored == 0 and cached == 0
    assert engine.close()


def test_save_on_compute_writes_each_block_once(tiny, tmp_path):
    """The evicting workload: every block is saved when computed, and neither the eviction
    that later takes it to the host tier nor a second engine that hits it writes it again."""
    reference = _reference(tiny)
    store = DiskStore(tmp_path / "kv", capacity_bytes=1 << 24)
    engine = _engine(tiny, offload=store)
    assert [t for t, _ in _run(engine, WORKLOAD)] == reference
    assert engine.close()
    saves = engine.runner.saves
    assert saves is not None
    assert engine.kv.stats()["blocks_offloaded"] > 0  # evictions happened ...
    assert saves.puts_repeated > 0  # ... and found their blocks already saved
    assert saves.blocks_saved_on_compute == saves.puts_submitted > 0
    assert store.stats.puts == saves.worker.completed_puts == saves.puts_submitted
    assert saves.worker.skipped_puts == 0 and saves.puts_dropped == 0
    puts = store.stats.puts
    again = _engine(tiny, offload=store, offload_deadline_s=LOAD_GUARD_S)
    assert [t for t, _ in _run(again, WORKLOAD)] == reference
    assert again.close()
    assert again.stats.store_hit_tokens > 0
    again_saves = again.runner.saves
    assert again_saves is not None
    # A block the second engine recomputed (the pool evicted it before it could hit) is in the
    # store already: the worker's contains skips it.
    assert store.stats.puts == puts
    assert again_saves.worker.completed_puts == 0
    assert again_saves.worker.skipped_puts == again_saves.puts_submitted


def test_the_seen_set_is_bounded_and_the_store_still_skips_what_it_holds(tiny, tmp_path, monkeypatch):
    """With room for 2 hashes the set forgets the prefix's blocks before the fillers evict
    them: the eviction queues them again, and the worker's ``contains`` skips each one, so the
    store still writes each block once."""
    from pagedkv.engine import store_saves

    monkeypatch.setattr(store_saves, "SEEN_CAPACITY", 2)
    reference = _reference(tiny)
    store = DiskStore(tmp_path / "kv", capacity_bytes=1 << 24)
    engine = _engine(tiny, offload=store)
    assert [t for t, _ in _run(engine, WORKLOAD)] == reference
    assert engine.close()
    saves = engine.runner.saves
    assert saves is not None
    assert len(saves._seen) <= 2
    assert saves.worker.skipped_puts > 0
    assert store.stats.puts == saves.blocks_saved_on_compute == saves.worker.completed_puts
    assert saves.puts_submitted == saves.blocks_saved_on_compute + saves.worker.skipped_puts


class _StuckDiskStore(DiskStore):
    """A store whose puts block until ``release`` is set (a disk or a network that hangs)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.release = threading.Event()

    def put(self, block_hash, payload, *, extra_key=None):
        self.release.wait(60.0)  # a step that waited for the store would hang here
        return super().put(block_hash, payload, extra_key=extra_key)


def test_a_full_save_queue_drops_saves_and_the_step_goes_on(tiny, tmp_path):
    from pagedkv.offload import OffloadWorker

    reference = _reference(tiny)
    store = _StuckDiskStore(tmp_path / "kv", capacity_bytes=1 << 24)
    engine = _engine(tiny, offload=store)
    saves = engine.runner.saves
    assert saves is not None and engine.store_worker is not None and engine.store_lookup is not None
    engine.store_worker.close()
    # One worker serves the engine's look-ups and saves: replace it everywhere.
    engine.store_worker = engine.store_lookup.worker = saves.worker = OffloadWorker(store, max_pending_puts=2)
    assert [t for t, _ in _run(engine, WORKLOAD)] == reference
    engine.kv.check_invariants()
    assert not store.release.is_set()  # every step ran while the store hung
    assert saves.puts_dropped > 0 and saves.worker.dropped_puts == saves.puts_dropped
    store.release.set()
    assert engine.close(timeout_s=30.0)
    assert store.stats.puts == saves.puts_submitted <= 3  # the stuck put and the 2 queued


class _BrokenDiskStore(DiskStore):
    def put(self, block_hash, payload, *, extra_key=None):
        raise RuntimeError("disk on fire")

    def contains(self, block_hash, *, extra_key=None):
        raise RuntimeError("disk on fire")


def test_a_store_failing_during_saves_costs_no_step(tiny, tmp_path):
    """Saves to a store whose calls raise, and to a Redis server that is not there: the same
    tokens, no error in any step, every failure counted by the worker."""
    reference = _reference(tiny)
    stores = [_BrokenDiskStore(tmp_path / "kv", capacity_bytes=1 << 24)]
    try:
        from pagedkv.offload import RedisStore

        stores.append(RedisStore(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.2))
    except ImportError:
        pass  # redis-py absent: the broken store still runs
    for store in stores:
        engine = _engine(tiny, offload=store, num_blocks=64)
        assert [t for t, _ in _run(engine, WORKLOAD)] == reference
        assert engine.close(timeout_s=30.0)
        saves = engine.runner.saves
        assert saves is not None
        assert saves.puts_submitted > 0
        assert saves.worker.failed_puts == saves.puts_submitted
        assert saves.worker.completed_puts == 0
        assert saves.worker.failures + store.stats.errors > 0


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
        smollm,
        offload=DiskStore(tmp_path / "kv", capacity_bytes=1 << 26),
        offload_deadline_s=LOAD_GUARD_S,
        **options,
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
    reader = _engine(tiny, offload=store, offload_deadline_s=LOAD_GUARD_S, max_num_seqs=1)
    ids = [reader.add_request(p, SamplingParams(max_tokens=5)) for p in (FILLERS[0], WORKLOAD[-1])]
    while reader.has_unfinished():
        reader.step()
    out = [reader.output(i) for i in ids]
    assert out[1].outputs[0].token_ids == reference[-1]
    assert out[1].num_cached_tokens == len(PREFIX)
    assert reader.store_lookup is not None
    assert reader.store_lookup.prefetched_blocks == len(PREFIX) // BS
    reader.close()


def test_random_schedules_with_offload_tiers_equal_each_request_alone(tiny, tmp_path):
    """The engine's randomized schedules (tests/engine/test_engine_randomized.py: preemption by
    recompute and swap, chunked prefill, n > 1, speculation, tiny pools) with a host offload
    tier, and in every other trial a DiskStore, where the trial runs a second time on a fresh
    engine (which hits the blocks the first run stored): every request's tokens equal running
    it alone. The store trials alternate the write policies: save-on-compute (blocks stored
    right after their pass, drafts' blocks and n > 1 forks included) and save-on-evict."""
    import dataclasses

    import numpy as np
    from test_engine_randomized import MAX_STEPS, _alone, _random_trial

    rng = np.random.default_rng(33)
    alone: dict = {}
    loaded = 0
    store_hits = {"compute": 0, "evict": 0}
    saved_on_compute = 0
    for trial in range(60):
        config, requests = _random_trial(rng, tiny, alone)
        with_store = trial % 2 == 1
        policy = "compute" if trial % 4 == 1 else "evict"
        config = dataclasses.replace(
            config,
            enable_prefix_caching=True,
            num_host_cache_blocks=int(rng.integers(1, 2 * config.num_blocks)),
            offload=DiskStore(tmp_path / f"kv{trial}", capacity_bytes=1 << 22) if with_store else None,
            offload_deadline_s=LOAD_GUARD_S,
            offload_policy=policy,
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
            store_hits[policy] += engine.stats.store_hit_tokens
            if engine.runner.saves is not None:
                saved_on_compute += engine.runner.saves.blocks_saved_on_compute
    assert loaded > 0 and min(store_hits.values()) > 0 and saved_on_compute > 0, (
        loaded,
        store_hits,
        saved_on_compute,
    )


def test_the_engine_refuses_offload_on_a_hybrid_layout():
    from tiny_hybrid import tiny_hybrid_model  # tests/engine, on the path above

    model = tiny_hybrid_model()
    with pytest.raises(InvalidArgumentError, match="hybrid_kv=False"):
        LLMEngine(model, EngineConfig(num_blocks=32, block_size=4, num_host_cache_blocks=8))
    engine = LLMEngine(
        model, EngineConfig(num_blocks=32, block_size=4, num_host_cache_blocks=8, hybrid_kv=False)
    )
    assert engine.kv.num_host_cache_blocks == 8


def test_num_offload_blocks_is_the_deprecated_name_of_num_host_cache_blocks(tmp_path):
    import dataclasses
    import warnings

    with pytest.warns(DeprecationWarning, match="num_host_cache_blocks"):
        config = EngineConfig(num_blocks=16, num_offload_blocks=8)
    assert config.num_host_cache_blocks == 8
    with pytest.warns(DeprecationWarning, match="num_host_cache_blocks"):
        assert config.num_offload_blocks == 8
    with pytest.warns(DeprecationWarning, match="num_host_cache_blocks"):
        assert config.offload_blocks == 8
    assert "num_offload_blocks" not in repr(config)
    with pytest.warns(DeprecationWarning), pytest.raises(InvalidArgumentError, match="disagrees"):
        EngineConfig(num_offload_blocks=8, num_host_cache_blocks=4)
    # One field holds the size in effect: a store alone gets a host cache of the pool's size.
    store = DiskStore(tmp_path / "kv", capacity_bytes=1 << 20)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with_store = EngineConfig(num_blocks=16, offload=store)
        assert with_store.num_host_cache_blocks == 16
        assert dataclasses.replace(with_store, max_num_seqs=2).num_host_cache_blocks == 16
        assert dataclasses.replace(with_store, num_host_cache_blocks=4).num_host_cache_blocks == 4
