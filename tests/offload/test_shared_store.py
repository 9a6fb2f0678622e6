"""A shared store serves the whole prompt another process computed (issue: two processes on
one Redis, the second served two thirds of a 500-token prompt on a busy machine, silently).

Process A computes a ~500-token prompt through a Redis store whose puts are slow, and exits
right after its last step without ``close()``: the ``atexit`` hook writes the puts still queued
(engine/store_flush.py). Process B, on a store whose gets are slow, serves the whole prompt
from it under the adaptive deadline (engine/store_lookup.py), where the fixed 50 ms of before
served a few blocks; both run while CPU burners keep the machine busy. The counters
(``EngineStats.store_*``) say what happened either way, and ``pagedkv generate --stats`` shows
them. The slow store calls make each case independent of how busy the machine happens to be."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("xxhash", reason="pagedkv.offload needs the offload extra (xxhash)")

ENGINE_TESTS = Path(__file__).resolve().parents[1] / "engine"
BLOCK_SIZE = 16
PROMPT = [(13 * i + 5) % 90 + 1 for i in range(500)]  # 31 full blocks before the last token
SERVABLE = (len(PROMPT) - 1) // BLOCK_SIZE * BLOCK_SIZE  # the last token is always computed

_PROCESS = textwrap.dedent(
    """
    import json, sys, time
    sys.path.insert(0, {engine_tests!r})
    from tiny_llama import tiny_model
    from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
    from pagedkv.offload import RedisStore

    class SlowStore(RedisStore):
        def put(self, *args, **kwargs):
            time.sleep({put_delay_s})  # A's puts queue up behind the steps
            return super().put(*args, **kwargs)

        def get(self, *args, **kwargs):
            time.sleep({get_delay_s})  # B's 31 gets take ~{get_total_ms} ms in all
            return super().get(*args, **kwargs)

    engine = LLMEngine(tiny_model(max_model_len=1024), EngineConfig(
        num_blocks=64, block_size={bs}, max_num_batched_tokens=512,
        offload=SlowStore({url!r}), **{options!r}))
    rid = engine.add_request({prompt!r}, SamplingParams(max_tokens=2))
    while engine.has_unfinished():
        engine.step()
    out = engine.output(rid)
    print(json.dumps(dict(cached=out.num_cached_tokens, queued=engine.store_worker.pending_puts,
                          stats=engine.stats.summary())))
    # no close(): the process ends here
    """
)


def _process(url: str, *, put_delay_s: float = 0.0, get_delay_s: float = 0.0, **options) -> dict:
    script = _PROCESS.format(
        engine_tests=str(ENGINE_TESTS),
        url=url,
        bs=BLOCK_SIZE,
        prompt=PROMPT,
        put_delay_s=put_delay_s,
        get_delay_s=get_delay_s,
        get_total_ms=round(get_delay_s * 31 * 1000),
        options=options,
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@contextlib.contextmanager
def _busy_machine(burners: int = 2):
    """CPU burners in other processes, as long as the block runs."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(burners)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_the_second_process_serves_the_whole_prompt_the_first_computed(redis_server):
    with _busy_machine():
        a = _process(redis_server.url, put_delay_s=0.03)
        assert a["queued"] > 0, "A wrote every block before it ended: the exit flush is not exercised"
        b = _process(redis_server.url, get_delay_s=0.01)
    assert (b["cached"], b["stats"]["store_deadline_misses"]) == (SERVABLE, 0), b
    assert b["stats"]["store_hit_tokens"] == SERVABLE


def test_a_fixed_deadline_too_short_for_the_store_is_counted(redis_server):
    _process(redis_server.url)  # fills the store
    b = _process(redis_server.url, get_delay_s=0.01, offload_deadline_s=0.05)
    assert b["cached"] < SERVABLE
    assert b["stats"]["store_deadline_misses"] == 1


def test_with_llm_closes_an_abandoned_stream_and_its_queued_blocks_reach_the_store(tmp_path):
    sys.path.insert(0, str(ENGINE_TESTS))
    from pagedkv.engine import LLM, SamplingParams
    from pagedkv.offload import DiskStore
    from tiny_llama import tiny_model

    class SlowPuts(DiskStore):
        def put(self, block_hash, payload, *, extra_key=None):
            time.sleep(0.02)  # the puts are still queued when the stream is abandoned
            return super().put(block_hash, payload, extra_key=extra_key)

    model = tiny_model(max_model_len=1024)
    store = SlowPuts(tmp_path / "kv", capacity_bytes=1 << 26)
    with LLM(model, block_size=BLOCK_SIZE, num_blocks=64, max_num_batched_tokens=512, offload=store) as llm:
        stream = llm.stream(PROMPT, SamplingParams(max_tokens=8))
        next(stream)  # the prefill ran; the stream is abandoned here
        engine = llm.last_engine
        assert engine is not None and engine.store_worker is not None
        assert engine.store_worker.pending_puts > 0
    # The with block closed the engine: every queued block written, counted in its stats.
    assert engine.store_worker.pending_puts == 0
    assert engine.stats.store_puts_written == SERVABLE // BLOCK_SIZE == store.stats.puts
    assert engine.stats.store_puts_dropped == 0
    stream.close()
    reader = LLM(model, block_size=BLOCK_SIZE, num_blocks=64, max_num_batched_tokens=512, offload=store)
    (out,) = reader.generate([PROMPT], SamplingParams(max_tokens=2))
    assert out.num_cached_tokens == SERVABLE


def test_dropped_puts_are_counted_in_the_engine_stats(tmp_path):
    sys.path.insert(0, str(ENGINE_TESTS))
    import threading

    from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
    from pagedkv.offload import DiskStore, OffloadWorker
    from tiny_llama import tiny_model

    class StuckPuts(DiskStore):
        release = threading.Event()

        def put(self, block_hash, payload, *, extra_key=None):
            self.release.wait(30.0)
            return super().put(block_hash, payload, extra_key=extra_key)

    store = StuckPuts(tmp_path / "kv", capacity_bytes=1 << 26)
    engine = LLMEngine(
        tiny_model(max_model_len=1024),
        EngineConfig(num_blocks=64, block_size=BLOCK_SIZE, max_num_batched_tokens=512, offload=store),
    )
    assert engine.store_worker is not None and engine.store_lookup is not None and engine.runner.saves
    engine.store_worker.close()
    worker = OffloadWorker(store, max_pending_puts=2)
    engine.store_worker = engine.store_lookup.worker = engine.runner.saves.worker = worker
    engine.add_request(PROMPT, SamplingParams(max_tokens=2))
    while engine.has_unfinished():
        engine.step()
    dropped = engine.stats.store_puts_dropped
    assert dropped > 0 and dropped == worker.dropped_puts == engine.runner.saves.puts_dropped
    assert engine.stats.summary()["store_puts_dropped"] == dropped
    assert not engine.close(timeout_s=0.2)  # the stuck put and the 2 queued: left behind
    assert engine.stats.store_puts_dropped > dropped
    store.release.set()


def test_cli_generate_stats_show_the_store(tmp_path, capsys):
    pytest.importorskip("gguf")
    pytest.importorskip("tokenizers")
    from pagedkv.cli import main
    from pagedkv.models import ModelLoadError, load_model

    try:
        load_model()
    except ModelLoadError as error:
        pytest.skip(f"default model not installed: {error}")
    prompt = "The quick brown fox jumps over the lazy dog. " * 4  # > 2 full blocks
    args = ["generate", prompt, "--max-tokens", "2", "--offload", str(tmp_path / "kv"), "--stats"]
    assert main(args) == 0
    first = capsys.readouterr().err
    assert "store: 0 prompt tokens served" in first and " 0 dropped" in first
    assert main(args) == 0  # a fresh engine: the prompt's blocks come from the store
    second = capsys.readouterr().err
    served = int(second.split("store:")[1].split("prompt tokens served")[0].strip())
    assert served >= 32, second
    assert "0 look-ups past the deadline" in second
